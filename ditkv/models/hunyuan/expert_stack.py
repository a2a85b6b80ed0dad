"""Stacked expert weights of the grouped MoE path (`layers.RoutedExperts`): one [E, out, in] tensor
per projection that IS the experts' storage, rebuilt whenever an expert weight stops being its row.
FP8 experts stack their per-row `weight_scale`s the same way."""

from __future__ import annotations

import torch
from torch import nn


def _weight(expert: nn.Module, proj: str) -> torch.Tensor:
    # dict lookups, not Module.__getattr__: this runs for every expert on every grouped step
    return expert._modules[proj]._parameters["weight"]


def _scale(expert: nn.Module, proj: str) -> torch.Tensor | None:
    return expert._modules[proj]._parameters.get("weight_scale")


def _row_pointers(stack: torch.Tensor) -> list[int]:
    step = stack.stride(0) * stack.element_size()
    return [stack.data_ptr() + i * step for i in range(stack.shape[0])]


def _stack_into_views(linears: list[nn.Linear], name: str = "weight") -> torch.Tensor:
    """Copy the linears' weights (or FP8 `weight_scale`s) into one [E, out, ...] tensor and make
    each a view of its row: afterwards the stack IS the experts' storage (state-dict names
    unchanged), and each old tensor is freed as soon as it is replaced, unless someone else still holds it."""
    first = linears[0]._parameters[name]
    # not an inference tensor even when built inside inference_mode, so load_state_dict can
    # still copy into the weights later
    with torch.inference_mode(False), torch.no_grad():
        stack = torch.empty((len(linears), *first.shape), dtype=first.dtype, device=first.device)
        for i, lin in enumerate(linears):
            old = lin._parameters[name]
            stack[i].copy_(old)
            lin._parameters[name] = nn.Parameter(stack[i], requires_grad=old.requires_grad)
    return stack


class ExpertStack:
    """Lazily stacked expert weights for the grouped path: w13 [E, 2I, H], w2 [E, H, I].

    The experts' parameters are re-pointed to rows of the stack (`_stack_into_views`), so it
    costs no memory beyond the experts' own; building it holds one extra copy of one projection
    of one layer's experts for a moment. Whenever an expert weight stops being its row (a
    `load_state_dict(assign=True)`, a sharded load, a `.to()`), the next use restacks. A copied
    or pickled module starts without a stack and builds its own.
    """

    def __init__(self) -> None:
        self.w13: torch.Tensor | None = None
        self.w2: torch.Tensor | None = None
        self.scales: tuple[torch.Tensor, torch.Tensor] | None = None  # FP8: (w13's, w2's) [E, out]
        self._experts: list[nn.Module] = []
        self._rows: list[tuple[int, int]] = []  # (w13 row, w2 row) addresses, per expert

    def __deepcopy__(self, memo) -> "ExpertStack":
        return ExpertStack()

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()

    def clear(self) -> None:
        self.__init__()

    def matches(self, experts: list[nn.Module]) -> bool:
        """Same expert modules, and each weight still the row it was re-pointed to (a moved, cast
        or replaced weight has another address). About 1 us per expert."""
        if self.w13 is None or len(experts) != len(self._experts):
            return False
        if any(a is not b for a, b in zip(experts, self._experts)):
            return False
        same = all(_weight(e, "gate_and_up_proj").data_ptr() == r13 and _weight(e, "down_proj").data_ptr() == r2
                   for e, (r13, r2) in zip(experts, self._rows))
        if not same or self.scales is None:
            return same and _scale(experts[0], "gate_and_up_proj") is None
        s13, s2 = self.scales
        return all(_scale(e, "gate_and_up_proj").data_ptr() == s13[i].data_ptr()
                   and _scale(e, "down_proj").data_ptr() == s2[i].data_ptr() for i, e in enumerate(experts))

    def get(self, experts: list[nn.Module]) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.matches(experts):
            self.build(experts)
        return self.w13, self.w2

    def build(self, experts: list[nn.Module]) -> None:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("MoE expert weights are not stacked (or changed) during CUDA graph capture; "
                               "call stack_experts(model) before capturing")
        self.clear()  # a stale stack goes first: never two stacks alive at once
        w13 = _stack_into_views([e.gate_and_up_proj for e in experts])
        w2 = _stack_into_views([e.down_proj for e in experts])
        if _scale(experts[0], "gate_and_up_proj") is not None:
            self.scales = (_stack_into_views([e.gate_and_up_proj for e in experts], "weight_scale"),
                           _stack_into_views([e.down_proj for e in experts], "weight_scale"))
        self.w13, self.w2, self._experts = w13, w2, list(experts)
        self._rows = list(zip(_row_pointers(w13), _row_pointers(w2)))
