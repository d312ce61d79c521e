"""Which batch opens a decode window (docs/architecture.md#decode-windows): the one batch
in flight schedules exactly the running requests, every one samples in it but perhaps the
last (left prefilling), and some request decodes ``MIN_WINDOW_STEPS`` batches more. The
conditions are the premises of the argument that a window batch is the batch
``schedule()`` makes (docs/architecture.md#why-a-window-batch-is-the-batch-schedule-makes).
"""

from __future__ import annotations

from kvtwin.sim.core.decode_window import DecodeWindow, WindowScheduler
from kvtwin.sim.core.request import Request, RequestStatus
from kvtwin.sim.core.scheduler_output import SchedulerOutput

# A window opens only if some member decodes at least this many batches more.
MIN_WINDOW_STEPS = 2


def open_decode_window(scheduler: WindowScheduler, in_flight: SchedulerOutput, sampled: dict[str, list[int]],
                       token_bases: list[int | None],
                       key_shapes: list[tuple[int, int]] | None = None) -> DecodeWindow | None:
    """A window over the running requests, if the batch ``in_flight`` (the only one, its
    tokens ``sampled``) is the batch that opens one and some request decodes
    ``MIN_WINDOW_STEPS`` batches more; else None. ``token_bases``: the executor's base per
    running request (None: it has sampled nothing, or its tokens are not ``base + index``);
    ``key_shapes``: the pricing's (``WindowPricing.decode_key_shapes``)."""
    # The proof counts on vLLM's two batches in flight, on a pool only the scheduler's own
    # passes change (no connector loading into it), and on one token per decode (no drafts).
    if not scheduler.can_open_window():
        return None
    running = scheduler.running_requests()
    n = len(running)
    scheduled = in_flight.num_scheduled_tokens
    if (n == 0 or len(scheduled) != n or len(sampled) != len(in_flight.num_output_tokens) or in_flight.preempted
            or n > scheduler.max_num_batched_tokens()):
        return None
    max_model_len = scheduler.max_model_len()
    longest = -1
    members: list[Request] = []
    bases: list[int] = []
    last_batches: list[int] = []
    prefilling: Request | None = None
    for k, ((request_id, num_tokens), request, base) in enumerate(zip(scheduled.items(), running, token_bases)):
        if (request_id != request.request_id or request.status is not RequestStatus.RUNNING
                or request.num_in_flight_tokens != num_tokens
                or request.num_prompt_tokens + request.max_tokens > max_model_len):
            return None
        if request_id not in in_flight.num_output_tokens:
            # A partial prefill chunk: only the last request may be left prefilling.
            if k != n - 1 or request.num_output_placeholders or request.num_computed_tokens >= request.num_tokens:
                return None
            prefilling = request
            continue
        # It samples in X (a decode, or the chunk that ends its prefill) and then decodes:
        # every token it has computed, one placeholder, only X's tokens in flight.
        if base is None or request.num_output_placeholders != 1 or request.num_computed_tokens != request.num_tokens:
            return None
        outputs = request.output_token_ids
        n0 = len(outputs)
        if n0 and outputs[-1] != base + n0 - 1:
            return None
        # Scheduled while c0 + j + 1 < P + max_tokens; X itself must not finish it.
        last = request.max_tokens - n0 - 2
        if last < 0:
            return None
        if last > longest:
            longest = last
        members.append(request)
        bases.append(base)
        last_batches.append(last)
    if longest < MIN_WINDOW_STEPS:
        return None
    return DecodeWindow(scheduler, members, bases, last_batches, prefilling, key_shapes)
