"""The custom ops through which a compiled graph drives the offload runtime, and the runtime registry.

Note [Compiled offload ops]. Under ``torch.compile`` a layer's code runs inside a compiled graph,
where no saved-tensor hook sees what autograd saves: the partitioned graph says which activations
the forward hands to the backward. The layer wrappers put a ``layer`` marker into the traced program
(Note [Traced layers] in ``annotate/_layers.py``); the fx pass (``_pass.py``) reads the markers and
puts in the ops below, each a call of the runtime eager mode uses (``OffloadSynchronizer.graph_*``:
side streams, events, pinned pool, prefetch schedule, statistics)::

    forward                                          backward
    step = begin(key, first, last)   step of this call   r = reach(token, m, after)   backward reached layer m
    token = save(x, step, i)         D2H of x, at save   u = load(tokens, after, ...)  take a unit's reload
    release(tokens, keep)            drop device copies  t = ready(u, tokens, after)   wait for it (mutates u)
                                                         x = as_strided(u, ...)        a tensor of the unit

The forward returns the token (an empty tensor on ``x``'s device carrying the runtime's record as a
Python attribute) in place of ``x``: the graph drops ``x`` after ``release``, and the runtime holds the
host copy until autograd frees the token. Data dependencies are the only ordering a compiler keeps,
so every op has them: ``keep`` holds the released activations (their buffers are not reused while a
D2H may read them) and tensors that exist only from the release point on (it cannot run earlier);
``reach`` follows the gradients its layer's backward starts from; ``load`` follows the point where
the runtime's schedule starts its layer's reload (``reach``, or for a paced one also the ``ready``
tokens up to half of the layer above, Note [Paced prefetch]), so the compiler counts the reload as
alive from where the runtime allocates it; ``ready`` follows the gradients of its unit's first use,
and as it mutates the unit every read of the unit's views follows it.

On CUDA the ops run on the compiled code's stream: ``save`` records a ready event on the compute
stream and enqueues the D2H on the side stream behind it; ``release`` makes the compute stream wait
for the layer's D2H before the graph may free ``x`` (no ``record_stream``: the allocator reuses the
block in compute-stream order, after the wait); ``load`` returns the reload the runtime allocated on
the compute stream when it enqueued the H2D (on demand: now), and ``ready`` makes the compute stream
wait for that H2D and counts the unit as used (no kernel reads the unit before it, so its block too is
reused in compute-stream order; the host buffer returns to the pool with the H2D's event). ``load``
returns one storage unit (Note [Storage units]) whole and the graph takes its tensors as views: what
an op returns is 16-byte aligned and owned by the graph (inductor may write into it), so a load per
tensor would copy each tensor of a shared unit (q of a fused qkv buffer spans nearly all of it).
Tokens live on the device: inductor treats a CPU input of a CUDA graph, and the outputs of an op with
one, as unaligned, losing vectorised loads. Each op but the markers does host work per call, so none
may be captured in a CUDA graph (``cudagraph_unsafe``).

``key`` names the runtime of one transformed model: a process-wide counter, so the same script gets
the same keys and a graph that a compile cache stored refers to the same model in a later run. It
and a checksum of the plan and of the pass's source are constants of the ``layer`` markers, which makes
them part of the traced program's cache key.
"""

from __future__ import annotations

import itertools
import pathlib
import weakref
import zlib
from typing import Any

import torch
from torch.fx.node import has_side_effect

from annotate_offload.errors import OffloadError

__all__: list[str] = []

TAG = "annotate_offload"  # the node.meta["custom"] key of a layer's nodes: (runtime key, layer index)
_RUNTIMES: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()
_KEYS = itertools.count()
_RECORD = "_annotate_offload_record"
_PASS_SOURCE = zlib.crc32(b"".join(pathlib.Path(__file__).with_name(n).read_bytes() for n in ("_ops.py", "_pass.py")))


def register(sync: Any) -> tuple[int, int]:
    """A new key for ``sync`` (the runtime of one transformed model; the registry holds it weakly), and a
    checksum of its plan and of this pass's code, which the markers carry so that no cached graph of another
    plan, or of another version of the pass, is reused."""
    key = next(_KEYS)
    _RUNTIMES[key] = sync
    plan = (sorted(sync.offloaded_layers), sync.num_layers, sync.min_offload_numel, sync.policy, sync.release_lag,
            _PASS_SOURCE)
    return key, zlib.crc32(repr(plan).encode())


def runtime(key: int) -> Any:
    """The runtime registered as ``key``, or ``None`` once its model is gone."""
    return _RUNTIMES.get(key)


def _token(sync: Any, record: Any, device: Any = "cpu") -> torch.Tensor:
    token = torch.empty(0, dtype=torch.uint8, device=device)
    setattr(token, _RECORD, (sync, record))
    return token


def _record(token: torch.Tensor) -> tuple:
    record = getattr(token, _RECORD, None)
    if record is None:
        raise OffloadError(
            "annotate_offload: a compiled graph got an offload token without its record: something copied "
            "the saved tensors of the compiled call (saved-tensor hooks around it, such as "
            "torch.autograd.graph.save_on_cpu). Remove those hooks; the transform offloads already."
        )
    return record


_UNSAFE = (torch.Tag.cudagraph_unsafe,)


@torch.library.custom_op("annotate_offload::layer", mutates_args=())
def layer(key: int, index: int, plan: int) -> None:
    """Marks the entry of layer ``index`` (``num_layers``: the end of the last layer); the pass reads
    and removes it, and it does nothing where it stays."""


@layer.register_fake
def _layer_fake(key: int, index: int, plan: int) -> None:
    from ._pass import install

    install()  # a graph with layers of this package is being traced: the pass must see its partition


@torch.library.custom_op("annotate_offload::begin", mutates_args=(), tags=_UNSAFE)
def begin(key: int, first: int, last: int) -> torch.Tensor:
    sync = runtime(key)
    if sync is None:
        raise OffloadError(
            f"annotate_offload: a compiled graph drives offload runtime {key}, whose model no longer exists in "
            "this process. Compile the transformed model in the process that runs it."
        )
    return _token(sync, sync.graph_begin(first, last))


@torch.library.custom_op("annotate_offload::save", mutates_args=(), tags=_UNSAFE)
def save(x: torch.Tensor, step: torch.Tensor, index: int) -> torch.Tensor:
    sync, record = _record(step)
    return _token(sync, sync.graph_pack(record, index, x), x.device)


@torch.library.custom_op("annotate_offload::release", mutates_args=(), tags=_UNSAFE)
def release(tokens: list[torch.Tensor], keep: list[torch.Tensor]) -> None:
    if tokens:
        sync, _ = _record(tokens[0])  # the pass releases one layer of one runtime per op
        sync.graph_release(_record(token)[1] for token in tokens)


@torch.library.custom_op("annotate_offload::reach", mutates_args=(), tags=_UNSAFE)
def reach(token: torch.Tensor, index: int, after: list[torch.Tensor]) -> torch.Tensor:
    sync, record = _record(token)
    sync.graph_reach(record, index)
    return torch.empty(0, dtype=torch.uint8, device=token.device)


@torch.library.custom_op("annotate_offload::load", mutates_args=(), tags=_UNSAFE)
def load(tokens: list[torch.Tensor], after: list[torch.Tensor], offsets: list[int], strides: list[int], numel: int,
         dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    sync, _ = _record(tokens[0])
    return sync.graph_unpack([_record(token)[1] for token in tokens], offsets, strides, numel, dtype)


@load.register_fake
def _load_fake(tokens: list[torch.Tensor], after: list[torch.Tensor], offsets: list[int], strides: list[int],
               numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(numel, dtype=dtype, device=device)


@torch.library.custom_op("annotate_offload::ready", mutates_args=("unit",), tags=_UNSAFE)
def ready(unit: torch.Tensor, tokens: list[torch.Tensor], after: list[torch.Tensor]) -> torch.Tensor:
    sync, _ = _record(tokens[0])
    sync.graph_ready([_record(token)[1] for token in tokens], unit.nbytes)
    return torch.empty(0, dtype=torch.uint8, device=unit.device)


@torch.library.custom_op("annotate_offload::mark", mutates_args=())
def mark(x: torch.Tensor, offload: bool) -> None:
    """``mark_not_offload`` (``offload=False``) or ``mark_activation_offload`` (``True``) in a traced
    program; the pass reads and removes it, and it does nothing where it stays."""


begin.register_fake(lambda key, first, last: torch.empty(0, dtype=torch.uint8))
save.register_fake(lambda x, step, index: torch.empty(0, dtype=torch.uint8, device=x.device))
reach.register_fake(lambda token, index, after: torch.empty(0, dtype=torch.uint8, device=token.device))
ready.register_fake(lambda unit, tokens, after: torch.empty(0, dtype=torch.uint8, device=unit.device))
for _op in (release, mark):
    _op.register_fake(lambda *args: None)
for _name in ("layer", "release", "reach", "ready", "mark"):
    has_side_effect(getattr(torch.ops.annotate_offload, _name).default)
