"""Peak bytes torch's CPU allocator holds while a call runs, above what it held before.

Read from ``torch.profiler`` with ``profile_memory=True``: every allocation and free is an
event carrying the allocator's running total, so the peak is the largest total seen minus the
total before the first event. Tensor storage only (Python objects are not counted); the
profiler's own bookkeeping is not a tensor and is not counted either. Used by the MoE
benchmarks to put the window statistic's pre-pass beside the training forwards and backwards.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

T = TypeVar("T")


def _allocations(prof: Any) -> list[tuple[int, int, int]]:
    """(time, bytes allocated (negative: freed), allocator total after it), in time order."""
    out, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.tag == _EventType.Allocation:
            fields = event.extra_fields
            out.append((event.start_time_ns, fields.alloc_size, fields.total_allocated))
    return sorted(out)


def peak_bytes(fn: Callable[[], T]) -> tuple[T, int]:
    """``fn()``'s result and the most bytes the CPU allocator held above its start meanwhile."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = _allocations(prof)
    if not events:
        return result, 0
    _, size, total = events[0]
    start = total - size
    return result, max(0, max(t for _, _, t in events) - start)
