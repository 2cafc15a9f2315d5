"""Policy objectives behind one interface (`Objective`): VCPO and every comparison objective.

One module per objective (`token_tis`, `mis`, `m2po`, `bapo`, `gspo`, `cispo`, `seq_tis`, `vcpo`, `otb`,
`tba`); the two families' shared parts — the PPO clip and the plain GRPO and Dr. GRPO (`clipped`), the
weighted log-likelihood and the plain REINFORCE and RLOO (`weighted`) — and the interface (`base`). Build
them by name with `vcpo.registry.make_objective`.

May import: `vcpo` (its top modules: the math the objectives compose).
"""

from vcpo.objectives.bapo import BAPO
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
from vcpo.objectives.cispo import CISPO
from vcpo.objectives.clipped import GRPO, DrGRPO, PpoClipOptions
from vcpo.objectives.gspo import GSPO
from vcpo.objectives.m2po import M2PO
from vcpo.objectives.mis import MIS
from vcpo.objectives.otb import OTB
from vcpo.objectives.seq_tis import SeqTIS
from vcpo.objectives.tba import TBA
from vcpo.objectives.token_tis import TokenTIS
from vcpo.objectives.vcpo import VCPO
from vcpo.objectives.weighted import RLOO, Reinforce, SequenceTisOptions

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
