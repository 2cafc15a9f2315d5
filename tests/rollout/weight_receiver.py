"""The receiving rank of a weight-update group, run as a subprocess by the SGLang stand-in (tests only).

`python -m tests.rollout.weight_receiver '<init_weights_update_group body as JSON>'` joins the group
as rank `rank_offset`, prints `joined`, then for each stdin line `{"specs": [[name, dtype, shape]...],
"out": path}` receives the broadcasts, saves them to `path` (safetensors) and prints `done`.
"""

from __future__ import annotations

import json
import sys

from safetensors.torch import save_file

from rollout.engines.weight_group import WeightGroup, receive_tensors


def main() -> None:
    init = json.loads(sys.argv[1])
    group = WeightGroup.join(
        init["backend"],
        init["master_address"],
        init["master_port"],
        init["world_size"],
        init["rank_offset"],
        init["group_name"],
        timeout_s=60,
    )
    print("joined", flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        tensors = receive_tensors(group, [tuple(spec) for spec in command["specs"]])
        save_file({name: tensor.contiguous() for name, tensor in tensors}, command["out"])
        print("done", flush=True)


if __name__ == "__main__":
    main()
