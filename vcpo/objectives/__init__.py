"""Policy objectives behind one interface (`Objective`): VCPO and every comparison objective.

Build them by name with `vcpo.registry.make_objective`.

May import: `vcpo` (its top modules: the math the objectives compose).
"""

from vcpo.objectives.base import (
    BatchContext,
    LossCounts,
    Objective,
    ObjectiveBase,
    PolicyLossInputs,
    PolicyLossOutput,
    PreparedBatch,
    Surrogate,
    prepare_batch,
)
from vcpo.objectives.clipped import BAPO, CISPO, GRPO, GSPO, M2PO, MIS, DrGRPO, PpoClipOptions, TokenTIS
from vcpo.objectives.tba import TBA
from vcpo.objectives.weighted import OTB, RLOO, VCPO, Reinforce, SeqTIS, SequenceTisOptions

__all__ = [
    "BAPO",
    "CISPO",
    "GRPO",
    "GSPO",
    "M2PO",
    "MIS",
    "OTB",
    "RLOO",
    "TBA",
    "VCPO",
    "BatchContext",
    "DrGRPO",
    "LossCounts",
    "Objective",
    "ObjectiveBase",
    "PolicyLossInputs",
    "PolicyLossOutput",
    "PpoClipOptions",
    "PreparedBatch",
    "Reinforce",
    "SeqTIS",
    "SequenceTisOptions",
    "Surrogate",
    "TokenTIS",
    "prepare_batch",
]
