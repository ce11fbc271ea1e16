"""The MSA sparse-attention backward of MiniMax M3 on PyTorch tensors.

The kernels are the project's generated PTX (Hopper ``sm_90a``, Blackwell ``sm_100a``), run by
the Rust runtime ``msa-runtime`` through the extension ``msa_ptx._native``. The API follows the
original NeMo AutoModel one: ``run_backward(q, k_aligned, v_aligned, grad_out, lse, out,
schedule) -> (dq, dk_aligned, dv_aligned)``, ``MSABackwardSchedule``, ``require_sm100``,
``sm_count``; ``python/README.md`` has the whole guide.

Behaviour on torch tensors:

* zero-copy: the kernels read and write the tensors' memory (``data_ptr()``), on
  ``torch.cuda.current_stream(device)``, with no host sync;
* outputs come from torch's caching allocator; the backward's workspace is cached per
  ``(device, stream)`` (``workspace_cache()``, ``clear_workspace_cache()``);
* inputs that are not contiguous or not 16-byte aligned are copied first (``_operand``);
* errors: ``TypeError`` for a wrong dtype, ``ValueError`` for a wrong shape or value (the
  schedule contract included), ``NotImplementedError`` for a device the kernels do not run on,
  ``RuntimeError`` for a CUDA driver failure; each with the Rust message.

``torch`` is imported only by the functions that need it, so the checks work without it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional, Tuple

from . import _native
from ._native import (  # noqa: F401  (re-exported contract constants and CTA-walk rules)
    BLOCK_SIZE,
    HEAD_DIM,
    INDEX_DIM,
    MAIN_HEADS_PER_INDEX,
    MAX_BUILD_TOKENS,
    MAX_TOKENS,
    NUM_INDEX_HEADS,
    NUM_KV_HEADS,
    NUM_Q_HEADS,
    QUERY_CHUNK,
    ROWS_PER_CTA_LARGE,
    ROWS_PER_CTA_SMALL,
    ROWS_PER_CTA_SWITCH,
    SOFTMAX_SCALE,
    TOPK_BLOCKS,
    chunk_map,
    clear_cp_cache,
    clear_workspace_cache,
    forward_workspace_cache,
    grid_launch_bound,
    rows_per_cta,
    workspace_cache,
)

__all__ = [
    "MSABackwardSchedule",
    "build_schedule",
    "run_backward",
    "run_forward",
    "to_aligned",
    "from_aligned",
    "msa_attention",
    "require_sm100",
    "require_supported",
    "sm_capability",
    "sm_count",
    "workspace_cache",
    "forward_workspace_cache",
    "clear_workspace_cache",
    "FORWARD_ALGORITHMS",
    "CPLayout",
    "cp_layout",
    "cp_slice",
    "cp_forward",
    "cp_backward",
    "cp_backward_status",
]

CPLayout = _native.CPLayout

_FIELDS = (
    "row_ptr",
    "q_indices",
    "scheduler_metadata",
    "work_count",
    "cu_seqlens",
    "document_workspace_starts",
)


def _torch():
    try:
        import torch
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("this msa_ptx function needs PyTorch (pip install torch)") from e
    return torch


# ---------------------------------------------------------------------------------------------
# Devices


def _device_index(device: Any) -> int:
    """The CUDA index of ``device`` (an int, ``"cuda"``, ``"cuda:N"``, a ``torch.device``);
    ``NotImplementedError`` for any other device type."""
    if isinstance(device, bool):
        raise TypeError(f"argument `device`: found {device!r}, expected a CUDA device")
    if isinstance(device, int):
        if device < 0:
            raise ValueError(f"argument `device`: found index {device}, expected an index >= 0")
        return device
    if isinstance(device, str):
        kind, _, index = device.partition(":")
        index = int(index) if index else None
    else:
        try:
            kind, index = device.type, device.index
        except AttributeError:
            raise TypeError(
                f"argument `device`: found an object of type {type(device).__name__}, "
                "expected a torch.device, a device string or an index") from None
    if kind != "cuda":
        raise NotImplementedError(
            f"argument `device`: found device type `{kind}`, expected a CUDA device "
            "(the MSA kernels run on compute capability 9.0 and 10.0)")
    if index is None:
        index = _torch().cuda.current_device()
    return index


@functools.lru_cache(maxsize=None)
def _device_info(index: int) -> Tuple[int, int, int]:
    return _native.device_info(index)


def sm_capability(device: Any) -> Tuple[int, int]:
    """The memoized compute capability ``(major, minor)`` of ``device``."""
    major, minor, _ = _device_info(_device_index(device))
    return major, minor


def sm_count(device: Any) -> int:
    """The memoized streaming-multiprocessor count of ``device``; it sizes the CTA walk."""
    return _device_info(_device_index(device))[2]


def require_sm100(device: Any) -> None:
    """The original gate: ``NotImplementedError`` unless ``device`` is SM100 (10.0).

    This package also runs on Hopper (9.0); ``require_supported`` accepts both."""
    cc = sm_capability(device)
    if cc != (10, 0):
        raise NotImplementedError(
            f"device {device}: compute capability {cc[0]}.{cc[1]}, expected 10.0 (SM100)")


def require_supported(device: Any) -> None:
    """``NotImplementedError`` unless the backward has a kernel for ``device`` (9.0 or 10.0)."""
    cc = sm_capability(device)
    supported = [tuple(c) for c in _native.supported_capabilities()]
    if cc not in supported:
        raise NotImplementedError(
            f"device {device}: compute capability {cc[0]}.{cc[1]}, expected one of "
            + ", ".join(f"{a}.{b}" for a, b in supported))


# ---------------------------------------------------------------------------------------------
# Operands


def _operand(tensor: Any) -> Any:
    """Return ``tensor`` detached, contiguous and on 16-byte-aligned storage, copying only when
    it is not (the original ``_operand``)."""
    tensor = tensor.detach()
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    if tensor.data_ptr() % 16:
        # A fresh allocation of the caching allocator is at least 512-byte aligned.
        tensor = tensor.clone()
    return tensor


def _host(tensor: Any) -> Any:
    """A contiguous CPU copy of ``tensor`` (``tensor`` itself when it already is one)."""
    if tensor.device.type == "cpu" and tensor.is_contiguous():
        return tensor
    return tensor.detach().cpu().contiguous()


# ---------------------------------------------------------------------------------------------
# The schedule


@dataclasses.dataclass(eq=False)
class MSABackwardSchedule:
    """Forward-derived int32 metadata the backward task build reads; save it with the tensors
    of ``ctx.save_for_backward``.

    ``scheduler_metadata`` columns are ``(index_head, row_linear, q_begin, q_count,
    document_ordinal, document_local_kblock)``, valid only up to ``work_count``. Shapes and
    dtypes are checked here: ``TypeError`` if a field is not int32, ``ValueError`` if a field
    does not have its shape (``row_ptr [4, rows+1]``, ``q_indices [4, edge_capacity]``,
    ``scheduler_metadata [work_capacity, 6]``, ``work_count [1]``, ``cu_seqlens
    [documents+1]``, ``document_workspace_starts [documents]``, all on one device).

    The values are checked against the whole contract once, by ``validate()`` (which
    ``run_backward`` calls): for fields on the GPU that copies them to the host once. A
    schedule made by ``build_schedule`` from a CUDA ``q2k`` was built on the device and needs
    no such copy; its verdict is read without blocking by ``poll()`` (``check()`` blocks).
    """

    row_ptr: Any
    q_indices: Any
    scheduler_metadata: Any
    work_count: Any
    cu_seqlens: Any
    document_workspace_starts: Any
    _handle: Any = dataclasses.field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        _native.check_schedule_fields(*self._fields())

    def _fields(self):
        return tuple(getattr(self, name) for name in _FIELDS)

    def validate(self) -> "MSABackwardSchedule":
        """Checks the values against the contract (``ValueError`` naming the field, value and
        expectation), once; returns ``self``. Do not modify the fields afterwards."""
        if self._handle is None:
            self._handle = _native.HostSchedule.from_fields(*(_host(t) for t in self._fields()))
        return self

    @property
    def on_device(self) -> bool:
        """Whether the schedule was built on the GPU (``build_schedule`` of a CUDA ``q2k``)."""
        return isinstance(self._handle, _native.ResidentSchedule)

    @property
    def num_tokens(self) -> int:
        """Tokens ``T``."""
        return self.validate()._handle.num_tokens

    @property
    def workspace_rows(self) -> int:
        """Rows ``W`` of the aligned K/V layout ``[W, 4, 128]``."""
        return self.validate()._handle.workspace_rows

    @property
    def num_documents(self) -> int:
        """Documents."""
        return self.validate()._handle.num_documents

    def poll(self) -> Optional[bool]:
        """``True`` once the schedule is known valid, ``None`` while a device build's verdict is
        still on its way; ``ValueError`` for an input the device build flagged (its backward
        then wrote zero gradients). Never blocks."""
        if self.on_device:
            return self._handle.poll()
        self.validate()
        return True

    def check(self) -> None:
        """Like ``poll`` but blocks until the verdict is known."""
        if self.on_device:
            self._handle.check()
        else:
            self.validate()


class _DeviceArray:
    """A device array of the runtime's memory for ``torch.as_tensor`` (zero-copy): a resident
    schedule's int32 tables (the tensor keeps this object, hence ``owner``'s memory, alive),
    or a buffer a collective reads or writes while the runtime holds it (``owner`` None)."""

    def __init__(self, owner: Any, ptr: int, shape: Tuple[int, ...], typestr: str = "<i4"):
        self._owner = owner
        self.__cuda_array_interface__ = {
            "shape": tuple(shape),
            "typestr": typestr,
            "data": (ptr, False),
            "strides": None,
            "version": 3,
            # Written by work on the current stream, which the tensor's users are ordered after.
            "stream": None,
        }


def build_schedule(q2k: Any, cu_seqlens: Any, *, workspace_rows: Optional[int] = None,
                   queries_per_work: int = 64) -> MSABackwardSchedule:
    """The backward's schedule from a block selection ``q2k [4, T, 16]`` (int32,
    document-local block ids, ``-1`` for padding) and ``cu_seqlens [D+1]`` (int32).

    A CUDA ``q2k`` is scheduled on its device, on the current stream (``T <=
    MAX_BUILD_TOKENS``): no host sync; a bad selection is flagged there and reported by
    ``poll()``/``check()``. ``workspace_rows`` is the ``W`` of the aligned K/V buffers the
    backward will get (default: the largest dense layout ``T`` tokens in ``D`` documents can
    need). A CPU ``q2k`` is scheduled on the host (any ``T <= MAX_TOKENS``, ``W`` the dense
    layout), and a bad selection raises ``ValueError`` here.
    """
    torch = _torch()
    if q2k.device.type == "cuda":
        device = q2k.device
        cu = cu_seqlens.to(device=device, dtype=torch.int32)
        q2k, cu = _operand(q2k), _operand(cu)
        stream = torch.cuda.current_stream(device).cuda_stream
        handle = _native.ResidentSchedule.build(q2k, cu, stream, workspace_rows, queries_per_work)
        fields = [torch.as_tensor(_DeviceArray(handle, ptr, shape), device=device)
                  for _, shape, ptr in handle.fields()]
    else:
        if workspace_rows is not None:
            raise ValueError("argument `workspace_rows`: only a CUDA q2k takes it (the host "
                             "build uses the dense layout)")
        handle = _native.HostSchedule.build(_host(q2k), _host(cu_seqlens), queries_per_work)
        fields = [torch.frombuffer(bytearray(data), dtype=torch.int32).reshape(shape)
                  for _, shape, data in handle.fields()]
    schedule = MSABackwardSchedule(*fields)
    schedule._handle = handle
    return schedule


def _schedule_handle(schedule: Any) -> Any:
    if not isinstance(schedule, MSABackwardSchedule):
        raise TypeError(f"argument `schedule`: found an object of type {type(schedule).__name__}, "
                        "expected an msa_ptx.MSABackwardSchedule")
    return schedule.validate()._handle


# ---------------------------------------------------------------------------------------------
# The aligned K/V layout


def _aligned_rows(schedule: MSABackwardSchedule, device: Any):
    """The workspace row of each compact token: ``document_workspace_starts[d] + t - cu[d]``."""
    torch = _torch()
    cu = schedule.cu_seqlens.to(device=device, dtype=torch.long)
    starts = schedule.document_workspace_starts.to(device=device, dtype=torch.long)
    t = torch.arange(schedule.num_tokens, device=device)
    doc = torch.searchsorted(cu[1:], t, right=True)
    return starts[doc] + t - cu[doc]


def to_aligned(k: Any, v: Any, schedule: MSABackwardSchedule):
    """Compact ``k``, ``v [T, 4, 128]`` into the schedule's aligned layout ``[W, 4, 128]``,
    every padding row zero (the backward requires it: a NaN there reaches dQ)."""
    rows = _aligned_rows(schedule, k.device)
    w = schedule.workspace_rows
    out = []
    for x in (k, v):
        a = x.new_zeros((w,) + tuple(x.shape[1:]))
        a[rows] = x
        out.append(a)
    return tuple(out)


def from_aligned(dk_aligned: Any, dv_aligned: Any, schedule: MSABackwardSchedule):
    """The compact ``dk``, ``dv [T, 4, 128]`` of aligned gradients ``[W, 4, 128]``."""
    rows = _aligned_rows(schedule, dk_aligned.device)
    return dk_aligned[rows], dv_aligned[rows]


# ---------------------------------------------------------------------------------------------
# The backward


def run_backward(q: Any, k_aligned: Any, v_aligned: Any, grad_out: Any, lse: Any, out: Any,
                 schedule: MSABackwardSchedule, *, deterministic: bool = False):
    """Run the MSA backward on THD-contract tensors of one CUDA device.

    Parameters: ``q`` bf16 ``[T, 64, 128]`` compact queries; ``k_aligned``, ``v_aligned`` bf16
    ``[W, 4, 128]`` keys and values in the schedule's 128-aligned workspace, padding rows zero
    (``to_aligned``); ``grad_out`` bf16 ``[T, 64, 128]``; ``lse`` fp32 ``[T, 64]`` the
    forward's natural-log log-sum-exp of the scaled scores; ``out`` bf16 ``[T, 64, 128]``;
    ``schedule`` the call's ``MSABackwardSchedule``.

    Returns bf16 ``(dq [T, 64, 128], dk_aligned [W, 4, 128], dv_aligned [W, 4, 128])``, zero
    outside the real rows. Runs on ``torch.cuda.current_stream(q.device)``; compute capability
    9.0 runs ``msa_backward_sm90``, 10.0 ``msa_backward_sm100``.

    ``deterministic=True`` gives bitwise reproducible gradients (the same bits on every call
    for the same inputs on the same device) at some cost in time and a larger cached workspace
    (``T * 32 KiB`` more; the README's "The deterministic mode").
    """
    if not isinstance(deterministic, bool):
        raise TypeError(f"`deterministic`: found {type(deterministic).__name__}, expected a bool")
    handle = _schedule_handle(schedule)
    _native.check_backward(q, k_aligned, v_aligned, grad_out, lse, out, handle)
    torch = _torch()
    q, k_aligned, v_aligned, grad_out, lse, out = (
        _operand(x) for x in (q, k_aligned, v_aligned, grad_out, lse, out))
    dq = torch.empty_like(q)
    dk_aligned = torch.empty_like(k_aligned)
    dv_aligned = torch.empty_like(v_aligned)
    stream = torch.cuda.current_stream(q.device).cuda_stream
    _native.run_backward(q, k_aligned, v_aligned, grad_out, lse, out, dq, dk_aligned,
                         dv_aligned, handle, stream, deterministic)
    return dq, dk_aligned, dv_aligned


# ---------------------------------------------------------------------------------------------
# Autograd


FORWARD_ALGORITHMS = ("auto", "q_parallel", "kv_parallel")


def _algorithm(algorithm: Any) -> str:
    """``algorithm`` checked before any work is enqueued: one of ``FORWARD_ALGORITHMS``."""
    if not isinstance(algorithm, str):
        raise TypeError(f"`algorithm`: found {type(algorithm).__name__}, expected a str")
    if algorithm not in FORWARD_ALGORITHMS:
        raise ValueError(f"`algorithm`: found {algorithm!r}, expected one of "
                         f"{', '.join(map(repr, FORWARD_ALGORITHMS))}")
    return algorithm


def _forward(q: Any, k_aligned: Any, v_aligned: Any, q2k: Any, schedule: MSABackwardSchedule,
             algorithm: str = "auto", deterministic: bool = False):
    """The MSA forward: ``(out [T, 64, 128] bf16, lse [T, 64] fp32, natural log)`` of
    ``q``, the aligned ``k``/``v`` and ``q2k`` on ``schedule``, which must have been built on
    the device from this ``q2k`` (``build_schedule`` of a CUDA ``q2k``), on
    ``torch.cuda.current_stream(q.device)``. ``algorithm`` (``msa_runtime::ForwardAlgorithm``):
    ``"auto"`` runs the KV-parallel ``msa_forward_kv_*_sm90`` on compute capability 9.0 for
    documents of 4096 tokens or more on average (1.1x faster at 4K-token documents and 3.4x
    at one 64K-token document on the H200) unless ``deterministic``, and the Q-parallel ``msa_forward_sm90`` (9.0) or
    ``msa_forward_sm100`` (10.0, never run on hardware, simulated in CI) otherwise;
    ``"q_parallel"`` and ``"kv_parallel"`` force one. A row with no key gets ``out = 0`` and
    ``lse = -inf``; so does every row when the schedule build flagged the selection. The KV
    forward gives a row with a NaN or infinite logit ``out = 0``, ``lse = NaN``."""
    _algorithm(algorithm)
    handle = _schedule_handle(schedule)
    torch = _torch()
    q, k_aligned, v_aligned, q2k = (_operand(x) for x in (q, k_aligned, v_aligned, q2k))
    t = q.shape[0]
    out = torch.empty_like(q)
    lse = torch.empty((t, q.shape[1]), dtype=torch.float32, device=q.device)
    stream = torch.cuda.current_stream(q.device).cuda_stream
    _native.run_forward(q, k_aligned, v_aligned, q2k, out, lse, handle, stream, algorithm,
                        deterministic)
    return out, lse


def run_forward(q: Any, k: Any, v: Any, q2k: Any, cu_seqlens: Any, *, algorithm: str = "auto"):
    """The MSA forward from compact tensors: ``q [T, 64, 128]``, ``k``, ``v [T, 4, 128]``
    (bf16), ``q2k [4, T, 16]`` and ``cu_seqlens [D+1]`` (int32, CUDA). Builds the schedule on
    the device, lays out K/V aligned and runs the forward ``algorithm`` picks (see
    ``_forward``), with no host sync; returns ``(out, lse, schedule, k_aligned, v_aligned)``,
    the last three for ``run_backward``."""
    _algorithm(algorithm)
    schedule = build_schedule(q2k, cu_seqlens)
    k_aligned, v_aligned = to_aligned(k, v, schedule)
    out, lse = _forward(q, k_aligned, v_aligned, q2k, schedule, algorithm)
    return out, lse, schedule, k_aligned, v_aligned


@functools.lru_cache(maxsize=None)
def _function():
    torch = _torch()

    class MSAAttention(torch.autograd.Function):
        """``out = MSA(q, k, v)`` for a block selection; the backward runs ``run_backward``."""

        @staticmethod
        def forward(ctx, q, k, v, q2k, cu_seqlens, deterministic, algorithm):
            ctx.deterministic = deterministic
            schedule = build_schedule(q2k, cu_seqlens)
            k_aligned, v_aligned = to_aligned(k, v, schedule)
            out, lse = _forward(q, k_aligned, v_aligned, q2k, schedule, algorithm, deterministic)
            ctx.save_for_backward(q, k_aligned, v_aligned, out, lse, *schedule._fields())
            ctx.schedule_handle = schedule._handle
            ctx.mark_non_differentiable(lse)
            return out, lse

        @staticmethod
        def backward(ctx, grad_out, _grad_lse):
            q, k_aligned, v_aligned, out, lse, *fields = ctx.saved_tensors
            schedule = MSABackwardSchedule(*fields)
            schedule._handle = ctx.schedule_handle
            dq, dk_aligned, dv_aligned = run_backward(
                q, k_aligned, v_aligned, grad_out, lse, out, schedule,
                deterministic=ctx.deterministic)
            dk, dv = from_aligned(dk_aligned, dv_aligned, schedule)
            return dq, dk, dv, None, None, None, None

    return MSAAttention


def msa_attention(q: Any, k: Any, v: Any, q2k: Any, cu_seqlens: Any, *,
                  deterministic: bool = False, algorithm: str = "auto"):
    """MSA attention as a ``torch.autograd.Function``: ``q [T, 64, 128]``, compact ``k``, ``v
    [T, 4, 128]`` (bf16), ``q2k [4, T, 16]`` and ``cu_seqlens [D+1]`` (int32); returns
    ``out [T, 64, 128]`` (``loss.backward()`` runs the MSA backward).

    The forward is the one ``algorithm`` picks (see ``_forward``: by default the KV-parallel
    one on 9.0 for long documents, else ``msa_forward_sm90`` / ``msa_forward_sm100``); the
    backward is ``run_backward``. ``deterministic``: the backward's bitwise reproducible mode
    and the Q-parallel forward (reproducible; ``algorithm="kv_parallel"`` is then an
    error). Not ``torch.compile``-able (see the README)."""
    if not isinstance(deterministic, bool):
        raise TypeError(f"`deterministic`: found {type(deterministic).__name__}, expected a bool")
    _algorithm(algorithm)
    out, _lse = _function().apply(q, k, v, q2k, cu_seqlens, deterministic, algorithm)
    return out


# ---------------------------------------------------------------------------------------------
# Context parallelism


def _group(group: Any) -> Tuple[int, int]:
    """``(rank, ranks)`` of ``group`` (``None``: the default process group)."""
    dist = _torch().distributed
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("context parallelism: torch.distributed has no process group "
                           "(call torch.distributed.init_process_group first)")
    return dist.get_rank(group), dist.get_world_size(group)


def _collectives(group: Any, device: Any, rank: int, ranks: int):
    """The runtime's two collectives on ``group``, on the current stream: an all-gather of
    bytes and an in-place reduce-scatter (sum) of f32."""
    torch = _torch()
    dist = torch.distributed

    def gather(send_ptr: int, nbytes: int, recv_ptr: int) -> None:
        send = torch.as_tensor(_DeviceArray(None, send_ptr, (nbytes,), "|u1"), device=device)
        recv = torch.as_tensor(_DeviceArray(None, recv_ptr, (nbytes * ranks,), "|u1"),
                               device=device)
        dist.all_gather_into_tensor(recv, send, group=group)

    def reduce_scatter(ptr: int, n: int) -> None:
        buf = torch.as_tensor(_DeviceArray(None, ptr, (n,), "<f4"), device=device)
        m = n // ranks
        # In place: NCCL's reduce-scatter allows recvbuff = sendbuff + rank * recvcount.
        dist.reduce_scatter_tensor(buf[rank * m:(rank + 1) * m], buf, group=group)

    return gather, reduce_scatter


def cp_layout(cu_seqlens: Any, group: Any = None) -> Any:
    """The rank layout (``CPLayout``) of the packed sequence ``cu_seqlens [D+1]`` (int32) over
    the ranks of ``group`` (``None``: the default process group): rank ``r`` holds the compact
    tokens ``layout.token_rows(r)`` (q, grad_out, out, lse, its rows of q2k) and the aligned
    K/V rows ``[r*S, (r+1)*S)``, ``S = layout.slice_rows`` (``cp_slice``)."""
    _, ranks = _group(group)
    return CPLayout([int(x) for x in _host(cu_seqlens).tolist()], ranks)


def cp_slice(x_aligned: Any, layout: Any, rank: int) -> Any:
    """Rank ``rank``'s rows ``[rank*S, (rank+1)*S)`` of an aligned ``[W, 4, 128]`` tensor of
    the whole sequence (``to_aligned``), zero past ``W``: a new contiguous tensor."""
    torch = _torch()
    s = layout.slice_rows
    start, end = rank * s, min((rank + 1) * s, x_aligned.shape[0])
    out = torch.zeros((s,) + tuple(x_aligned.shape[1:]), dtype=x_aligned.dtype,
                      device=x_aligned.device)
    if end > start:
        out[:end - start].copy_(x_aligned[start:end])
    return out


def cp_forward(q: Any, k_slice: Any, v_slice: Any, q2k_local: Any, layout: Any, *,
               group: Any = None):
    """This rank's MSA forward in a context-parallel group: ``q [T_r, 64, 128]`` (its
    tokens), its K/V slices ``[S, 4, 128]`` (bf16) and its rows of the selection ``q2k_local
    [4, T_r, 16]`` (int32, document-local block ids). K/V are all-gathered over ``group``
    (``torch.distributed``, NCCL) on the current stream. A CUDA ``q2k_local`` is scheduled on
    the device with no host copy or sync (a bad selection is flagged there:
    ``schedule.check()`` raises ``ValueError``, and the rank's rows come out empty); a CPU one
    is validated on the host first. Returns ``(out [T_r, 64, 128], lse [T_r, 64],
    schedule)``; pass ``schedule`` to ``cp_backward``."""
    torch = _torch()
    rank, _ = _group(group)
    q, k_slice, v_slice = (_operand(x) for x in (q, k_slice, v_slice))
    out = torch.empty_like(q)
    lse = torch.empty((q.shape[0], q.shape[1]), dtype=torch.float32, device=q.device)
    gather, _ = _collectives(group, q.device, rank, layout.ranks)
    stream = torch.cuda.current_stream(q.device).cuda_stream
    q2k_local = _operand(q2k_local) if q2k_local.device.type == "cuda" else _host(q2k_local)
    schedule = _native.cp_forward(layout, rank, q, k_slice, v_slice, q2k_local, out, lse,
                                  stream, gather)
    return out, lse, schedule


def cp_backward(q: Any, k_slice: Any, v_slice: Any, grad_out: Any, lse: Any, out: Any,
                layout: Any, schedule: Any, *, group: Any = None):
    """This rank's MSA backward in a context-parallel group, on ``schedule`` (``cp_forward``'s,
    or ``layout.local_schedule(rank, q2k_local)``): the rank's ``q``, ``grad_out``, ``out [T_r,
    64, 128]`` and ``lse [T_r, 64]``, and its K/V slices ``[S, 4, 128]``. K/V are
    all-gathered and the fp32 dK/dV reduce-scattered over ``group`` on the current stream.
    Returns ``(dq [T_r, 64, 128], dk_slice, dv_slice [S, 4, 128])`` (bf16): dq is the rank's,
    dk/dv its slice's, summed over every rank's queries."""
    torch = _torch()
    rank, _ = _group(group)
    q, k_slice, v_slice, grad_out, lse, out = (
        _operand(x) for x in (q, k_slice, v_slice, grad_out, lse, out))
    dq = torch.empty_like(q)
    dk_slice = torch.empty_like(k_slice)
    dv_slice = torch.empty_like(v_slice)
    gather, reduce_scatter = _collectives(group, q.device, rank, layout.ranks)
    stream = torch.cuda.current_stream(q.device).cuda_stream
    _native.cp_backward(layout, rank, q, k_slice, v_slice, grad_out, lse, out, dq, dk_slice,
                        dv_slice, schedule, stream, gather, reduce_scatter)
    return dq, dk_slice, dv_slice


def cp_backward_status(device: Any = None):
    """The group's verdict on the last ``cp_backward`` on ``device``'s current stream
    (synchronizes it): ``None`` when no rank's device schedule was flagged; ``ValueError``
    naming every flagged rank otherwise, on every rank, since a flagged rank's queries are
    missing from every rank's dK/dV (its own ``schedule.check()`` names the fault).
    ``RuntimeError`` when no ``cp_backward`` ran on that stream."""
    torch = _torch()
    device = torch.device("cuda", torch.cuda.current_device()) if device is None \
        else torch.device(device)
    stream = torch.cuda.current_stream(device).cuda_stream
    return _native.cp_backward_status(device.index, stream)
