"""The inference engines behind `rollout.base.InferenceEngine`: HF transformers (`hf_engine`, `hf_batch`,
`sampling`, on the `step_runtime` worker thread), vLLM (`vllm_engine`, `vllm_worker`), SGLang
(`sglang_engine`, `sglang_launcher`), any OpenAI-compatible server (`openai_engine` over
`http_client`), the backend `factory`, and the weight-push helpers (`checkpoint`, `weight_group`).

May import: `rollout` (its top modules: the protocol, types, errors, settings, models, request_record).
"""
