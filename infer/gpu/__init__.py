"""GPU backend: CUDA kernels through CuPy. CuPy is imported lazily, so this package imports (and
its NumPy parts run) on machines without it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from infer.arch import ModelArgs
    from infer.gguf_file import GGUFModel
    from infer.gpu.model import GpuTransformer
    from infer.tiers.budget import VramAccount


def gpu_available() -> bool:
    """True when CuPy imports and sees at least one CUDA device."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def resolve_device(device: str) -> str:
    """'auto' -> 'gpu' when CuPy sees a GPU, else 'cpu'; 'gpu' without one is a one-line ValueError."""
    if device not in ("auto", "cpu", "gpu"):
        raise ValueError(f"unknown device '{device}' (known: auto, cpu, gpu)")
    if device == "cpu":
        return "cpu"
    if gpu_available():
        return "gpu"
    if device == "gpu":
        raise ValueError("--device gpu: no CUDA GPU is visible to CuPy (install cupy-cuda13x, check the driver)")
    return "cpu"


def gpu_pass_nbytes(model: GGUFModel, args: ModelArgs, capacity: int, context: int,
                    logits_rows: int | None = None, layers: Sequence[int] | None = None) -> int:
    """Device bytes of a GpuTransformer's pass buffers for `capacity` rows a pass (a prompt chunk,
    a batch, a tree) over caches of up to `context` positions, and its rotary tables (`layers`: of
    a stage of those layers, infer.gpu.stages: the head's buffers with the last layer)."""
    from infer.arch import output_name
    from infer.gpu.model import LOGITS_ROWS, pass_buffers_nbytes
    from infer.gpu.weights import layer_formats, matrix_format

    layers = range(args.n_layers) if layers is None else layers
    formats = [layer_formats(model, i) for i in layers]
    out_act = matrix_format(model.tensor(output_name(model))).act
    rows = max(LOGITS_ROWS, logits_rows or 0)
    tables = 2 if args.rope_base_local else 1  # Gemma's local layers rotate by their own table
    return (pass_buffers_nbytes(args, formats, out_act, capacity, context, rows, head=args.n_layers - 1 in layers)
            + tables * 8 * context * (args.rope_dim // 2))


def load_gpu_transformer(model: GGUFModel, max_context: int | None = None, vram_budget: str | int | None = None,
                         prefill_chunk: int = 512, batch: int = 1, enforce_budget: bool = False,
                         planned: dict[str, int] | None = None, tree_nodes: int = 0,
                         kv_positions: int | None = None,
                         progress: Callable[[int, int], None] | None = None,
                         experts: str | int = "auto", expert_stream: str | int = "auto",
                         layers: Sequence[int] | None = None) -> GpuTransformer:
    """The model checked as infer.model.load_transformer checks it, its weights resident on the
    current GPU, planned against the VRAM budget (`vram_budget`, default the free memory less a
    margin): weights, the KV caches of `batch` sequences of `max_context` positions (default the
    model's, at most 4096), the buffers of passes of `prefill_chunk` rows (logits for `tree_nodes`
    rows at once when verifying trees that large; kv_positions: the KV cache positions of all
    sequences together, when they are not `batch` of the full context). A model that does not fit raises VramBudgetError
    (one line, what each part takes, a hint to use --streaming). enforce_budget: cap CuPy's memory
    pool at the budget (process-wide). planned: device memory already taken in the same budget
    (e.g. {"draft model": bytes}), shown in the plan. progress(done, total): after each layer's
    upload (a load bar). experts (a mixture of experts): "gpu" keeps every expert in VRAM and
    computes the blocks there, "cpu" leaves them in RAM for the CPU to compute (llama.cpp's
    --cpu-moe), an int N the first N blocks' experts to the CPU and the rest in VRAM (--n-cpu-moe),
    "auto" all in VRAM when they fit the budget beside the rest, else as many of the last blocks' as fit.
    expert_stream (blocks the CPU computes): "auto" streams their experts to the GPU for passes of
    many prompt rows (infer.gpu.expert_stream; its staging planned first), "off" never, an int N
    from N prompt rows. layers: only these blocks, a stage of a pipeline across the GPUs of a host
    (infer.gpu.stages.load_gpu_stages), planned on the current GPU. The inputs of the matrix products are rounded
    as llama.cpp rounds them (8-bit forms for quantized weights); every row's logits are the same
    bits in any pass (docs/GPU.md)."""
    import cupy

    from infer.arch import check_model, refuse_cpu_only, rope_freq_factors
    from infer.errors import UnsupportedModelError
    from infer.gpu import memory
    from infer.gpu.layout import format_of
    from infer.gpu.model import GpuTransformer
    from infer.gpu.weights import ResidentWeights
    from infer.tiers.plan import planner_tensors, span
    from infer.tiers.stage_plan import stage_tensors

    args = check_model(model)
    refuse_cpu_only(args, model.path, "the GPU engine")
    for info in model.tensors.values():
        if len(info.shape) == 2:
            try:
                format_of(info.ggml_type)
            except ValueError as err:
                raise UnsupportedModelError(model.path, str(err), f"tensor {info.name}") from None
    context = max_context or min(args.context_length, 4096)
    stage = tuple(range(args.n_layers)) if layers is None else tuple(sorted(layers))
    where = "the GPU" if len(stage) == args.n_layers else \
        f"GPU {cupy.cuda.Device().id} (layers {span(stage)})"
    account = memory.new_account(vram_budget, f"{model.path.name} on {where}")
    tensors = stage_tensors(planner_tensors(model, "gpu"), model, stage, args.n_layers)
    weights_nbytes = sum(t.device_nbytes for t in tensors)
    account.plan("weights", weights_nbytes)
    # the global layers keep every position; a local layer a ring of its window and a pass per sequence
    positions = kv_positions or batch * context
    kv = args.kv_cache_nbytes(context, prefill_chunk, sequences=batch, positions=positions, layers=stage)
    layout = args.kv_cache_layout(context, prefill_chunk)
    account.plan(f"KV cache ({layout})" if layout else "KV cache", kv + 4 * (positions + 2 * batch))
    logits_rows = max(batch, tree_nodes)
    account.plan("pass buffers", gpu_pass_nbytes(model, args, prefill_chunk, context, logits_rows, stage))
    for name, nbytes in (planned or {}).items():
        account.plan(name, nbytes)
    experts_on_gpu, experts_why, stream_rows = _place_experts(model, args, account, prefill_chunk, experts, stage,
                                                              expert_stream) if args.n_experts else ([], None, 0)
    account.check(": lower -c/--ctx-size, or run on the CPU (--device cpu)" if args.n_experts else
                  ": run with --streaming (or lower -c/--ctx-size)")  # no streamed GPU engine for experts yet
    if enforce_budget:
        memory.enforce(account)
    steps = len(experts_on_gpu)  # the experts' uploads: a step per block after the rest

    def weights_progress(done: int, total: int) -> None:
        if progress is not None:
            progress(done, total + steps)

    with memory.arena(weights_nbytes, len(tensors)):
        weights = ResidentWeights(model, args, weights_progress, layers=stage)
    cupy.cuda.Device().synchronize()
    cupy.get_default_memory_pool().free_all_blocks()  # the uploads' temporaries
    from infer.gpu.model import LOGITS_ROWS

    gpu = GpuTransformer(args, weights, rope_freq_factors(model, args), context, prefill_chunk=prefill_chunk,
                         logits_rows=max(LOGITS_ROWS, logits_rows), layers=stage)
    gpu.account = account
    on_cpu = sorted(set(stage) - set(experts_on_gpu)) if args.n_experts else []
    if experts_on_gpu or stream_rows:
        from infer.gpu.expert_stream import ExpertStream
        from infer.gpu.experts import GpuExperts

        done = len(stage) + 1  # the layers' uploads (ResidentWeights' steps), then the experts
        stream = None
        if stream_rows:
            try:
                stream = ExpertStream(model, args, on_cpu, stream_rows)
            except cupy.cuda.runtime.CUDARuntimeError as err:  # page-locking refused (limits, driver)
                experts_why = f"{experts_why or 'placed'}; not streamed to the GPU: page-locking their pages failed ({err})"
        if experts_on_gpu or stream is not None:
            gpu.use_gpu_experts(GpuExperts(model, args, prefill_chunk, experts_on_gpu,
                                           lambda j: weights_progress(done + j, done), stream=stream))
            cupy.get_default_memory_pool().free_all_blocks()
    if on_cpu:  # these blocks' experts stay in the file's pages; the CPU computes their feed-forward
        from infer.tiers.cpu_tier import CpuExperts

        gpu.cpu_experts = CpuExperts(model, args, why=experts_why, layers=on_cpu)
        if gpu.gpu_experts is not None and gpu.gpu_experts.stream is not None:  # or shares it with the GPU
            from infer.gpu.expert_split import PickSplit, choose_gpu_slots

            slots, why = choose_gpu_slots(args)
            if slots:
                gpu.gpu_experts.split = PickSplit(gpu.gpu_experts, slots, why)
    return gpu


EXPERT_PLACES = ("auto", "gpu", "cpu")
# "auto" keeps VRAM for streaming the CPU's blocks to the GPU (long prompts) when the staging costs at
# most this share of what the experts in VRAM would otherwise take (30B-A3B at 8 GB: ~10%)
STREAM_SHARE = 0.25


def _stream_least(args: ModelArgs, rows: int, stream: str | int) -> int:
    """--expert-stream as prompt rows from which the CPU's blocks stream to the GPU (0: never)."""
    from infer.gpu.expert_stream import min_prompt_rows

    if isinstance(stream, int) and not isinstance(stream, bool):
        if stream < 1:
            raise ValueError(f"--expert-stream takes auto, off or a count of prompt rows, not {stream}")
        least = stream
    elif stream == "off":
        return 0
    elif stream == "auto":
        least = min_prompt_rows(args)
    else:
        raise ValueError(f"--expert-stream takes auto, off or a count of prompt rows, not {stream!r}")
    return least if least <= rows else 0


def _place_experts(model: GGUFModel, args: ModelArgs, account: VramAccount, rows: int, where: str | int,
                   stage: range | None = None, stream: str | int = "auto") -> tuple[list[int], str | None, int]:
    """(the blocks whose experts go to VRAM, planned in `account`; why the others stay in RAM for
    the CPU, None when none does; the prompt rows from which those others stream to the GPU, 0 for
    never: --expert-stream). `where`: "gpu" every block, "cpu" none (--cpu-moe), an int N the first N
    blocks on the CPU (llama.cpp's --n-cpu-moe N), "auto" every block when they fit the budget beside
    the rest, else the most of the last blocks that fit beside the stream's staging. Float stacks
    stay with the CPU ("gpu": an error). stage: the blocks of this GPU (a pipeline's stage), every
    block by default."""
    from infer.errors import UnsupportedModelError
    from infer.gpu import experts as on_gpu
    from infer.gpu.expert_stream import stream_nbytes
    from infer.gpu.ops import UPLOAD_CHUNK_BYTES
    from infer.tiers.plan import format_bytes

    blocks = list(range(args.n_layers) if stage is None else stage)
    n = len(blocks)
    if isinstance(where, int) and not isinstance(where, bool):
        if where < 0:
            raise ValueError(f"--n-cpu-moe takes a count of blocks, not {where}")
        on_device, why = [i for i in blocks if i >= where], f"asked for (--n-cpu-moe {where})"
    elif where not in EXPERT_PLACES:
        raise ValueError(f"experts go to one of {', '.join(EXPERT_PLACES)} or a count of blocks, not {where!r}")
    elif where == "cpu":
        on_device, why = [], "asked for (--cpu-moe)"
    else:
        on_device, why = list(blocks), None
    least = _stream_least(args, rows, stream)  # a bad --expert-stream fails here, whatever the placement
    unsupported = on_gpu.stacks_on_device(model, args)
    if unsupported is not None:
        if where == "gpu":
            raise UnsupportedModelError(model.path, unsupported, "experts on the GPU")
        return [], why if where == "cpu" else unsupported, 0
    sizes = {i: on_gpu.block_bytes(model, i) + on_gpu.BUFFER_ROUNDING * on_gpu.MATRICES_PER_BLOCK for i in on_device}
    buffers = on_gpu.buffers_nbytes(model, args, rows)
    room = account.room - buffers - UPLOAD_CHUNK_BYTES  # kept for an upload's transient copy of GGUF bytes
    if where == "auto":
        fit = _last_blocks_that_fit(on_device, sizes, room)
        if len(fit) < n and least and on_gpu.stacks_group(model, blocks):
            staging = stream_nbytes(model, blocks)  # at most: the CPU's blocks are not chosen yet
            if staging <= STREAM_SHARE * max(sum(sizes[i] for i in fit), room):
                fit = _last_blocks_that_fit(on_device, sizes, room - staging)  # the stream's staging first
            else:
                least = 0
        if not fit and not least:
            total = sum(sizes.values()) + buffers
            return [], (f"their {format_bytes(total)} do not fit the {format_bytes(max(account.room, 0))} the VRAM "
                        "budget leaves"), 0
        if len(fit) < n:
            why = f"the VRAM budget leaves room for the experts of {len(fit)} of {n} blocks"
        on_device = sorted(fit)
    on_cpu = [i for i in blocks if i not in on_device]
    staging = stream_nbytes(model, on_cpu) if least and on_cpu and on_gpu.stacks_group(model, on_cpu) else 0
    if staging > room - sum(sizes[i] for i in on_device):
        staging = 0  # a placement asked for: the staging only where it fits beside it
    if on_device:
        account.plan("experts", sum(sizes[i] for i in on_device))
    if on_device or staging:
        account.plan("expert buffers", buffers)
    if staging:
        account.plan("expert stream", staging)
    return on_device, why, least if staging else 0


def _last_blocks_that_fit(blocks: list[int], sizes: dict[int, int], room: int) -> list[int]:
    """The most of the last `blocks` whose sizes fit `room` (llama.cpp's --n-cpu-moe leaves the first to the CPU)."""
    fit: list[int] = []
    for i in reversed(blocks):
        if sizes[i] > room:
            break
        room -= sizes[i]
        fit.append(i)
    return fit
