# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The split-k workspace of `_C::exl3_linear`: one fp32 buffer per device, from torch's
caching allocator (as Marlin's `marlin_make_workspace_new`), so vLLM's memory
profiling sees it.

The op keeps it all zeros between calls (its finish kernel re-zeroes what it read), so
every layer on the device shares it. It is sized at load time, as layers finish
loading, to the most any of their plans needs (m_bucket x n floats for a split-k or
stream-k bucket), capped; a call whose partial sums do not fit runs with split 1
instead.
"""

import torch

# Beyond this many bytes split-k is not worth its partial sums; plans needing more run
# split 1.
MAX_WORKSPACE_BYTES = 512 << 20
MAX_WORKSPACE_FLOATS = MAX_WORKSPACE_BYTES // 4


class Exl3Workspace:
    """The device's buffer; layers read `.tensor` at call time, so growing it while
    later layers load reaches the earlier ones too (nothing grows it after loading)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.tensor = torch.zeros(0, dtype=torch.float32, device=device)

    def reserve(self, floats: int) -> None:
        floats = min(floats, MAX_WORKSPACE_FLOATS)
        if floats > self.tensor.numel():
            self.tensor = torch.zeros(floats, dtype=torch.float32, device=self.device)


_workspaces: dict[torch.device, Exl3Workspace] = {}


def workspace_for(device: torch.device) -> Exl3Workspace:
    """The workspace every layer on `device` shares (a CUDA device without an index
    is the current one)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _workspaces:
        _workspaces[device] = Exl3Workspace(device)
    return _workspaces[device]
