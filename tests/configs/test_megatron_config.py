"""`learner.backend` / `learner.megatron`: defaults, and every unsupported layout refused with its fix."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from configs.schema import LearnerConfig, MegatronConfig, RunConfig


def test_the_torch_backend_is_the_default_and_megatron_defaults_to_one_rank() -> None:
    learner = RunConfig().learner
    assert learner.backend == "torch"
    assert (learner.megatron.tensor_model_parallel_size, learner.megatron.pipeline_model_parallel_size,
            learner.megatron.context_parallel_size) == (1, 1, 1)


def test_a_megatron_layout_with_tensor_parallelism_validates() -> None:
    config = LearnerConfig.model_validate({"backend": "megatron", "megatron": {
        "tensor_model_parallel_size": 4, "sequence_parallel": True, "transformer_impl": "transformer_engine",
        "use_distributed_optimizer": True}})
    assert config.megatron.tensor_model_parallel_size == 4


def test_a_megatron_layout_with_pipeline_stages_and_context_parallelism_validates() -> None:
    config = LearnerConfig.model_validate({"backend": "megatron", "megatron": {
        "tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 4, "context_parallel_size": 2}})
    assert (config.megatron.pipeline_model_parallel_size, config.megatron.context_parallel_size) == (4, 2)


@pytest.mark.parametrize(("fields", "fix"), [
    ({"context_parallel_size": 2, "transformer_impl": "transformer_engine"},
     "context_parallel_size=2 needs transformer_impl='local'"),
    ({"sequence_parallel": True, "transformer_impl": "transformer_engine"},
     "set tensor_model_parallel_size ≥ 2"),
    ({"sequence_parallel": True, "tensor_model_parallel_size": 2},
     "needs transformer_impl='transformer_engine'"),
    ({"recompute_method": "block"}, "recompute_method='block' applies to recompute_granularity='full' only"),
    ({"recompute_granularity": "selective", "recompute_num_layers": 2},
     "recompute_num_layers applies to recompute_granularity='full' only"),
])
def test_unsupported_megatron_layouts_name_the_field_and_the_fix(fields: dict, fix: str) -> None:
    with pytest.raises(ValidationError, match=fix):
        MegatronConfig.model_validate(fields)


def test_a_typo_in_the_megatron_section_is_an_error() -> None:
    with pytest.raises(ValidationError, match="tensor_parallel_size"):
        LearnerConfig.model_validate({"megatron": {"tensor_parallel_size": 2}})


@pytest.mark.parametrize(("fields", "fix"), [
    ({"model": {"dtype": "bfloat16"}, "learner": {"autocast": "bfloat16"}},
     "over fp32 master weights, but model.dtype is 'bfloat16'; set model.dtype='float32'"),
    ({"learner": {"backend": "megatron", "autocast": "bfloat16"}},
     "megatron has its own mixed precision .* set learner.autocast='none' and model.dtype='bfloat16'"),
])
def test_bf16_autocast_needs_fp32_weights_and_the_torch_learner(fields: dict, fix: str) -> None:
    with pytest.raises(ValidationError, match=fix):
        RunConfig.model_validate(fields)
    assert RunConfig.model_validate({"learner": {"autocast": "bfloat16"}}).learner.autocast == "bfloat16"


def test_megatron_recompute_validates_and_hf_gradient_checkpointing_is_pointed_to_it() -> None:
    megatron = MegatronConfig.model_validate({"recompute_granularity": "full", "recompute_method": "block",
                                              "recompute_num_layers": 2})
    assert (megatron.recompute_method, megatron.recompute_num_layers) == ("block", 2)
    with pytest.raises(ValidationError, match=r"learner\.megatron\.recompute_granularity='full'"):
        RunConfig.model_validate({"model": {"gradient_checkpointing": True},
                                  "learner": {"backend": "megatron"}})
