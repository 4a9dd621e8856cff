"""SGLang's rank body in the rank pool (``Engine.rank_body``; the pool, ``gpu/rank_pool.py``,
names no engine): one step through the release's own ``FlashinferDispatcher`` on this rank,
on the real kernels or, in a pool without a GPU, on the emulated ``MoeAlltoAll``
(``emulator/gloo.py``). The runtime SGLang passes is agreed on by every rank, through the
pool's ``agree``, before its kernel launches; ``state["example"]["launched"]`` tells the pool
whether a failure came before any collective (SGLang's own code refusing: the ranks are in
step) or after.
"""
from __future__ import annotations

__all__ = ["run_example"]


def run_example(state, rank, ep_size, world, spec, bypass, ctx=None) -> dict:
    """SGLang's own ``FlashinferDispatcher`` on this rank, end to end on the real kernels (or,
    in a pool without a GPU, on the emulated ``MoeAlltoAll`` of ``emulator/gloo.py``):
    its ``__init__`` builds its ``MoeAlltoAll`` (over the pool's group), its ``dispatch()``
    launches the real dispatch kernel with the runtime it computes, the stand-in experts run
    on what arrived, its ``combine()`` returns the result, checked against the reference."""
    import numpy as np
    import torch

    from ..emulator.a2a import POISON
    from ..emulator.rounds import expected_recv_counts
    from ..emulator.inputs import make_inputs, reference_outputs
    from ..gpu import torch_ops
    from ..gpu.checks import rank_problems
    from ..model.sglang_context import SGLangContext
    from ..model.mnnvl import aux_offsets
    from .loader import release_from_spec
    from .standins import StandardTopKOutput

    engines, cpu = state["engines"], state["cpu"]
    if spec not in engines:
        release = release_from_spec(spec.partition(":")[2],
                                    flashinfer="emulated" if state["emulated"] else "real")
        release.process_group = cpu
        engines[spec] = release
    release, ctx = engines[spec], ctx or SGLangContext()
    state["example"] = {"world": world, "bypass": bypass, "values": None, "launched": False}
    emulated = state["emulated"]
    device = "cpu" if emulated else "cuda"
    inputs = make_inputs(world)
    inp = inputs[rank]
    x = torch.from_numpy(inp.x).to(device, torch.bfloat16)
    ids = torch.from_numpy(inp.expert_ids).to(device)
    weights = torch.from_numpy(inp.weights).to(device)
    with release.as_rank(world, rank, ctx):
        d = release.dispatcher(world, rank, ctx)  # collective the first time a shape is seen
        a2a = d.moe_a2a
        _agree_before_launch(a2a, state)
        if not emulated:  # the model's planes start poisoned for every call
            a2a.workspace[rank][aux_offsets(ep_size, a2a.max_num_tokens).payload_data:].fill_(POISON)
            torch.cuda.synchronize()  # poisoned before the agreement inside dispatch(), a barrier
        out = d.dispatch(x, StandardTopKOutput(weights, ids, None))
        runtime = state["example"]["values"][rank]
        topk = out.topk_output
        y = torch_ops.stand_in_moe(out.hidden_states.float()[None], topk.topk_ids[None],
                                   topk.topk_weights[None], torch.tensor([rank], device=device),
                                   world.moe.num_experts, ep_size)[0]
        result = d.combine(release.module(world.flashinfer).FlashinferCombineInput(y))
    expected = expected_recv_counts(world, inputs)[rank].copy()
    reference = reference_outputs(world, [inp])[0]
    if emulated:
        counts, output = a2a.last_recv_counts.astype(np.int32), torch_ops.read_back([result])[0]
    else:
        rc = int(a2a.metainfo[state["index"]["RECV_COUNTERS_OFFSET_INDEX"]])
        counts, output = torch_ops.read_back([a2a.workspace[rank][rc:rc + 4 * ep_size], result])
        counts = counts.view(np.int32)
    if world.rows_per_rank[rank] == 0 and counts[rank] == 1:
        expected[rank] = 1  # releases before 0.5.15 send one dummy token to themselves
    problems = rank_problems(rank, None, runtime, counts, expected, output, reference)
    return {"problems": problems, "values": state["example"]["values"],
            "max_num_tokens": a2a.max_num_tokens,
            "workspace_size_per_rank": a2a.workspace_size_per_rank}


def _agree_before_launch(a2a, state):
    """Wrap this ``MoeAlltoAll``'s ``dispatch`` (FlashInfer's object, not SGLang's code):
    every rank all-gathers the runtime SGLang passes and, unless bypassed, validates it on
    the CPU before the kernel; a rank launching alone would leave its peers spinning."""
    if getattr(a2a, "_a2a_gate_agreed", False):
        return
    from ..gpu.rank_examples import agree
    from ..model.validation import validate

    launch = a2a.dispatch

    def dispatch(token_selected_experts, input_payloads, runtime_max_tokens_per_rank, *a, **k):
        example = state["example"]
        example["launched"] = True  # from here on ranks wait for each other
        agreed = agree(state, runtime_max_tokens_per_rank)
        example["values"] = agreed
        if example["bypass"] is False:
            validate(agreed, example["world"].views, example["world"].generation)
        return launch(token_selected_experts, input_payloads, runtime_max_tokens_per_rank, *a, **k)
    a2a.dispatch = dispatch
    a2a._a2a_gate_agreed = True
