"""Layer forwards: how ``offload_transform`` wraps each declared layer, and the state they share.

Note [Layer forwards]. Each declared layer gets an instance-level ``forward`` (the way torchtitan
applies activation checkpointing to ``model.layers``). ``nn.Module.__call__`` finds it before the
class's ``forward``, so module hooks (FSDP2's, peft's) still run around it, and inside it the
layer's own code runs unchanged::

    enter layer i's offload scope -> the layer's forward -> commit its output (close the scope and
                                     (class or earlier        mark the layer boundary for backward)
                                     instance forward)

Nothing above the layers is traced or replaced. The index ``i`` is fixed per wrapper, so eval forwards,
skipped layers and repeated forwards cannot desynchronise it. Outside a training forward (autograd off,
or a checkpoint's recompute in backward), and inside the layer's own open scope (a user forward set
later that calls the earlier wrapper), the wrapper only calls the forward.

Note [Traced layers]. Under ``torch.compile`` Dynamo traces the wrapper (no graph break): it runs the
forward inside ``torch.fx.traceback.annotate`` with the tag ``(key, i)`` (``key``: the model's
runtime, Note [Compiled offload ops] in ``compile/_ops.py``) and puts a ``layer`` marker op at the
entry of layer ``i`` (and after the last layer) with the key and a checksum of the plan. AOTAutograd
carries the tag onto every forward and backward node of the layer, and the fx pass in
``compile/_pass.py`` offloads the saved activations of the partitioned graph through the same runtime.
No scope opens in traced code, so the adapter marks' hooks stand aside there. Dynamo guards on
``key``, the plan, the layer index and the grad mode, so a model transformed, removed or copied later
gets its own graph.

The wrappers hold weak references to their layer and to the transform's state, which the model
owns: a transformed model has no reference cycle and is freed when its last reference goes, like
an untransformed one.

Note [Layer input at entry]: at the entry of an offloaded layer its input is marked ready
(``mark_ready``: an event, no copy). If autograd saves it in the layer, its D2H waits for that
event; if only a cast of it is saved (a conv or linear first under autocast), it is never copied.

Note [Following the model]: at the start of each training forward the state checks that every
slot still holds its layer (O(L) lookups). A layer replaced in place (``model.layers[1] =
Block()``), or given a new instance ``forward``, is wrapped from that forward on; a layer that is
gone or moved is refused with its name. When modules were registered anywhere since the last
forward (peft's ``get_peft_model`` after the transform), the adapter marks are refreshed.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import sys
import threading
import weakref
from typing import Any, Callable, Iterator

import torch
import torch.fx.traceback
import torch.nn as nn
import torch.utils.checkpoint as _cp
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from annotate_offload.compile._ops import TAG, register as register_runtime
from annotate_offload.errors import OffloadError
from annotate_offload.runtime._context import checked_saves, inside_checkpoint
from annotate_offload.runtime._layer_state import _counter
from annotate_offload.runtime._marks import mark_ready
from annotate_offload.runtime._synchronizer import _identity, _recording

__all__: list[str] = []

_ORIG_CHECKPOINT = _cp.checkpoint
_REENTRANT_FORWARD = _cp.CheckpointFunction.forward.__code__
_GENERATION = [0]  # modules registered anywhere in the process (Note [Following the model])
_HOOK: list[Any] = []


def _count_registration(module: nn.Module, name: str, submodule: Any) -> None:
    if not torch.compiler.is_compiling():  # a model that registers modules in its forward must not recompile
        _GENERATION[0] += 1


def generation() -> int:
    """Module registrations so far (a global hook counts them from the first call on)."""
    if not _HOOK:
        _HOOK.append(nn.modules.module.register_module_module_registration_hook(_count_registration))
    return _GENERATION[0]


def _in_reentrant_checkpoint() -> bool:
    """Called from ``torch.utils.checkpoint(use_reentrant=True)``'s forward, which runs the layer
    without autograd (a few frames up, past ``Module.__call__`` and this wrapper)."""
    frame = sys._getframe(2)
    for _ in range(8):
        if frame is None:
            return False
        if frame.f_code is _REENTRANT_FORWARD:
            return True
        frame = frame.f_back
    return False


def _refuse_pickle(self: Any, protocol: Any = None) -> Any:
    raise OffloadError(
        "offload_transform: a model with offloading applied cannot be pickled (torch.save(model)): its "
        "layers drive a runtime with CUDA side streams and host buffers that do not outlive the process. "
        "Save model.state_dict() instead (its keys are unchanged by offload_transform), or call "
        "remove_offload(model) before torch.save(model) and offload_transform again after loading."
    )


class LayerForward:
    """The instance-level ``forward`` of declared layer ``index`` (Note [Layer forwards]).

    ``prev`` is the instance-level forward the layer had before (``None``: the class's).
    ``inspect.signature`` sees the wrapped forward's signature.
    """

    __slots__ = ("state", "module", "index", "prev")
    __reduce_ex__ = _refuse_pickle

    def __init__(self, state: "OffloadState", module: nn.Module, index: int, prev: Any) -> None:
        self.state = weakref.ref(state)
        self.module = weakref.ref(module)
        self.index, self.prev = index, prev

    def target(self) -> Callable[..., Any]:
        """The forward this wrapper runs: the earlier instance forward, or the class's, bound."""
        if self.prev is not None:
            return self.prev
        module = self.module()
        return type(module).forward.__get__(module, type(module))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        state = self.state()
        if state is None:  # the model is gone and the layer lives on: a plain module
            return self.target()(*args, **kwargs)
        if torch.compiler.is_compiling():  # Dynamo on torch 2.11 does not trace function.__get__
            module = self.module()
            fn = self.prev if self.prev is not None else functools.partial(type(module).forward, module)
            return state.traced(self.index, fn, args, kwargs)
        return state.run(self.index, self.target(), args, kwargs)

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(self.target())

    def __deepcopy__(self, memo: dict) -> "LayerForward":
        # the copy of a copied model's layer belongs to the copied model's state (reached through memo); a
        # layer copied alone belongs to no model: a plain module, which a later transform may take
        new = LayerForward.__new__(LayerForward)
        memo[id(self)] = new
        whole = (state := self.state()) is not None and id(state.model()) in memo
        new.state = _copied_ref(self.state, memo) if whole else (lambda: None)  # a reference that stays dead
        new.module = _copied_ref(self.module, memo)
        new.index, new.prev = self.index, copy.deepcopy(self.prev, memo)
        return new

    def __repr__(self) -> str:
        return f"<offloaded forward of layer {self.index}>"


class OffloadState:
    """What ``offload_transform`` applied to one model (``model.__dict__["_annotate_offload_state"]``):
    the model (weakly: it holds this state), the layers' names and modules, the runtime ``sync``, the
    ``plan``, and ``recompute``: the checkpointed layers, ``True`` where selective (Note [Selective
    recompute])."""

    __reduce_ex__ = _refuse_pickle

    def __init__(self, model: nn.Module, fqns: list[str], layers: list[nn.Module], sync: Any, plan: Any,
                 recompute: dict[int, bool]) -> None:
        self.model = weakref.ref(model)
        self.fqns, self.layers = list(fqns), list(layers)
        self.sync, self.plan, self.recompute = sync, plan, recompute
        self.offloaded = frozenset(plan.offloaded_layers)
        self.marks: Any = None  # peft OffloadMarks on the model
        self.own_marks = False  # installed by offload_transform (removed with it)
        self.generation = generation()
        self.key, self.plan_id = register_runtime(sync)  # Note [Traced layers]
        self._fresh()

    def _fresh(self) -> None:
        self.open_layer: int | None = None
        self.owner: int | None = None  # thread that opened the scope
        self.last_entered = -1
        self.measured = self.standing_aside = False
        self.estimating: set[int] | None = None  # layers entered in the meta estimate's forward

    # -- wrapping -------------------------------------------------------------------------------
    def wrapper(self, i: int) -> LayerForward | None:
        w = self.layers[i].__dict__.get("forward")
        return w if isinstance(w, LayerForward) and w.state() is self and w.index == i else None

    def wrap(self, i: int) -> None:
        module, prev = self.layers[i], self.layers[i].__dict__.get("forward")
        if isinstance(prev, LayerForward):  # the wrapper of a model that is gone (_check_positions)
            prev = prev.prev
        module.__dict__["forward"] = LayerForward(self, module, i, prev)

    def unwrap(self, i: int) -> None:
        w = self.wrapper(i)
        if w is None:
            return
        if w.prev is None:
            del self.layers[i].__dict__["forward"]
        else:
            self.layers[i].__dict__["forward"] = w.prev

    @contextlib.contextmanager
    def aside(self) -> Iterator[None]:
        """The model's own code for a while (the planner's profile): the layers' forwards unwrapped and the
        schedule's tuning held back, all put back after."""
        wrapped = {i: w for i in range(len(self.layers)) if (w := self.wrapper(i)) is not None}
        for i in wrapped:
            self.unwrap(i)
        self.standing_aside = True
        try:
            yield
        finally:
            self.standing_aside = False
            for i, w in wrapped.items():  # the same objects: what compiled code guards on stays valid
                self.layers[i].__dict__["forward"] = w

    def remove(self) -> None:
        self.sync.abort()
        for i in range(len(self.layers)):
            self.unwrap(i)
        if self.own_marks and self.marks is not None:
            self.marks.remove()

    # -- one layer call -------------------------------------------------------------------------
    def run(self, index: int, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        if index in self.recompute and torch.is_grad_enabled() and self.layers[index].training:  # as HF's checkpointing
            fn = _checkpointed(fn, self.layers[index], self.recompute[index])
        if not _recording():
            if index in self.offloaded and not torch.is_grad_enabled() and _in_reentrant_checkpoint():
                self._refuse_checkpoint(index, "torch.utils.checkpoint(use_reentrant=True), which runs it without "
                                        "autograd")
            return fn(*args, **kwargs)
        if inside_checkpoint():
            # Note [A checkpoint around the layer] (runtime/_context.py): kept layers stand aside
            if index in self.offloaded:
                self._refuse_checkpoint(index, "torch.utils.checkpoint(use_reentrant=False)")
            return fn(*args, **kwargs)
        if self.open_layer == index and self.owner == threading.get_ident():
            return fn(*args, **kwargs)  # inside its own scope: a user forward wrapping an earlier wrapper
        self._enter(index, args, kwargs)
        try:
            out = fn(*args, **kwargs)
        except BaseException:
            self.abort()
            raise
        return self._commit(out, index)

    def traced(self, index: int, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """One layer call as Dynamo traces it (Note [Traced layers])."""
        if index in self.recompute and torch.is_grad_enabled() and self.layers[index].training:
            fn = _checkpointed(fn, selective=self.recompute[index])
        if not torch.is_grad_enabled():
            return fn(*args, **kwargs)
        key, plan, layer = self.key, self.plan_id, torch.ops.annotate_offload.layer
        with torch.fx.traceback.annotate({TAG: (key, index)}):
            layer(key, index, plan)
            out = fn(*args, **kwargs)
        if index == len(self.layers) - 1:
            layer(key, index + 1, plan)
        return out

    def _enter(self, index: int, args: tuple, kwargs: dict) -> None:
        me = threading.get_ident()
        if self.open_layer is not None:
            if self.owner != me:
                raise OffloadError(
                    f"offload_transform: layer {index} ({self.fqns[index]}) started on one thread while another "
                    f"thread is running layer {self.open_layer} ({self.fqns[self.open_layer]}) of the same model: "
                    "the model is in use on another thread, and one transformed model runs one training forward "
                    "at a time. Give each thread its own copy (copy.deepcopy(model) has its own runtime)."
                )
            raise OffloadError(
                f"offload_transform: layer {index} ({self.fqns[index]}) started inside layer {self.open_layer} "
                f"({self.fqns[self.open_layer]}); offload scopes cannot nest. Declare only the outer one a layer "
                "(layer_types= or filter_fn=)."
            )
        if self.estimating is not None:
            if index in self.estimating:
                raise OffloadError(
                    f"offload_transform: layer {index} ({self.fqns[index]}) runs more than once in one forward "
                    "(found with example_inputs=); one layer must be one offload unit. Leave it out of the layers "
                    "(filter_fn=, layer_types=) or give each call its own module."
                )
            if self.estimating and index < (last := max(self.estimating)):
                raise OffloadError(
                    f"offload_transform: layer {index} ({self.fqns[index]}) runs after layer {last} "
                    f"({self.fqns[last]}) in one forward (found with example_inputs=); layers are numbered in "
                    "registration order, and the runtime schedules their copies in that order, so it must be the "
                    "order they run. Register the blocks in the order the forward calls them, or pick layers that "
                    "run in that order (filter_fn=, layer_types=)."
                )
            self.estimating.add(index)
        elif index <= self.last_entered or self.last_entered < 0:
            self._follow_model()  # a new forward
        self.sync.enter_layer(index)
        self.open_layer, self.owner, self.last_entered = index, me, index
        if index in self.offloaded:
            t = next((t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)), None)
            if t is not None and t.requires_grad:
                mark_ready(t)  # Note [Layer input at entry]

    def _commit(self, out: Any, index: int) -> Any:
        self.open_layer = self.owner = None
        out = self.sync.commit_layer(out, index)
        if index == len(self.layers) - 1 and not self.measured and self.estimating is None:
            # every offloaded layer's copies were issued at save time: the first step's bytes are known
            self.measured = True
            self.plan._with_bytes(dict(self.sync.stats.bytes_offloaded_per_layer), "measured")
        return out

    def abort(self) -> None:
        """After an exception in a layer: close the scope and drop this step's runtime state."""
        self.open_layer = self.owner = None
        self.last_entered = -1
        self.sync.abort()

    def _refuse_checkpoint(self, index: int, how: str) -> None:
        raise OffloadError(
            f"offload_transform: layer {index} ({self.fqns[index]}) runs inside {how} around its call. That "
            "checkpoint saves only the layer's input, before the layer's offload scope opens, and recomputes the "
            "rest, so nothing could be offloaded. Fix: remove the checkpoint around the layer and pass "
            "config=ModelConfig(cpu_offloading=True, recompute=True) to offload_transform (it checkpoints each "
            "layer inside its scope and offloads what the checkpoint saves), or keep this layer on the device."
        )

    # -- Note [Following the model] -------------------------------------------------------------
    def _follow_model(self) -> None:
        model = self.model()
        if model is None:
            return
        for i, fqn in enumerate(self.fqns):
            try:
                found = model.get_submodule(fqn)
            except AttributeError:
                found = None
            if found is not self.layers[i] or self.wrapper(i) is None:
                self._adopt(i, found)
        now = generation()
        if now != self.generation:
            self.generation = now
            if self.marks is not None:
                self.marks.refresh()

    def _adopt(self, i: int, found: nn.Module | None) -> None:
        fqn = self.fqns[i]
        other = None if found is None else next((j for j, m in enumerate(self.layers) if m is found and j != i), None)
        if found is None or other is not None or isinstance(found.__dict__.get("forward"), LayerForward):
            what = ("is gone" if found is None else
                    f"now holds layer {other} ({self.fqns[other]})" if other is not None else
                    "now holds a layer of another transformed model")
            raise OffloadError(
                f"offload_transform: {fqn} (layer {i}) {what} since the transform; the layers changed. Call "
                "remove_offload(model) and offload_transform(model, ...) again after changing the layers."
            )
        if found is not self.layers[i]:
            self.unwrap(i)
            self.layers[i] = found
            self.plan._replace_layer(i, type(found).__name__)
        self.wrap(i)

    # -- copies ---------------------------------------------------------------------------------
    def __deepcopy__(self, memo: dict) -> "OffloadState":
        # Note [Copying a synchronizer] (runtime/_synchronizer.py): the copy of a model runs its own
        # runtime (a fresh one, same configuration) on its own layers
        new = OffloadState.__new__(OffloadState)
        memo[id(self)] = new
        new.model = _copied_ref(self.model, memo)
        new.fqns, new.recompute, new.offloaded = self.fqns, self.recompute, self.offloaded
        new.layers = copy.deepcopy(self.layers, memo)
        new.sync, new.plan = copy.deepcopy(self.sync, memo), copy.deepcopy(self.plan, memo)
        new.key, new.plan_id = register_runtime(new.sync)
        new.marks, new.own_marks = copy.deepcopy(self.marks, memo), self.own_marks
        new.generation = self.generation
        new._fresh()
        return new


def _copied_ref(ref: weakref.ref, memo: dict) -> weakref.ref:
    """A weak reference to the deep copy of ``ref``'s referent (a dead reference stays dead)."""
    obj = ref()
    return ref if obj is None else weakref.ref(copy.deepcopy(obj, memo))


def _checkpointed(fn: Callable[..., Any], module: nn.Module | None = None, selective: bool = False
                  ) -> Callable[..., Any]:
    """``fn`` under non-reentrant ``torch.utils.checkpoint``, ``selective``: keeping the outputs of
    :func:`saved_ops` (Note [Selective recompute]); its recompute in backward writes into copies of
    ``module``'s buffers.

    Note [Buffers in a recompute]: a forward that updates buffers (BatchNorm's running statistics) would
    update them again when the checkpoint reruns it, so the buffers would differ from the run without it.
    The checkpoint's recompute context gives the rerun clones of the buffers, dropped after it: the
    buffers are written once, by the forward (BatchNorm's training output does not read them).
    """
    if module is None:  # traced (Note [Traced layers]): Dynamo takes torch's own contexts only
        contexts = (functools.partial(_cp.create_selective_checkpoint_contexts, selective_policy) if selective
                    else _cp.noop_context_fn)
    else:
        def contexts() -> tuple:
            if not selective:
                return checked_saves(contextlib.nullcontext()), _FreshBuffers(module, contextlib.nullcontext())
            kept: list = []
            hooks = torch._C._autograd._top_saved_tensors_default_hooks(False) or (_identity, _identity)
            return checked_saves(_KeepOutputs(kept, hooks[0])), _FreshBuffers(module, _ReuseOutputs(kept, hooks[1]))

    def run(*args: Any, **kwargs: Any) -> Any:  # the layer's keywords by closure: checkpoint takes some names
        return _ORIG_CHECKPOINT(lambda *a: fn(*a, **kwargs), *args, use_reentrant=False, context_fn=contexts)

    return run


class _KeepOutputs(TorchDispatchMode):
    """A selective checkpoint's forward (Note [Selective recompute]): saves the outputs of :func:`saved_ops`,
    in call order, each through ``pack``, and watches their version counters."""

    def __init__(self, kept: list, pack: Callable[[torch.Tensor], Any]) -> None:
        super().__init__()
        self.kept, self.pack = kept, pack

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in saved_ops():
            leaves, spec = tree_flatten(out)
            # beneath autograd an alias shares its base's version counter only with ADInplaceOrView on
            with torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.ADInplaceOrView, False):
                aliases = [x.detach() if isinstance(x, torch.Tensor) else x for x in leaves]
                watched = [(_counter(a), a._version) for a in aliases if isinstance(a, torch.Tensor)]
            self.kept.append((func, spec, [(True, self.pack(a)) if isinstance(a, torch.Tensor) else (False, a)
                                           for a in aliases], watched))
        return out


class _ReuseOutputs(TorchDispatchMode):
    """A selective checkpoint's rerun: hands the kept outputs back, through ``unpack``, in call order."""

    def __init__(self, kept: list, unpack: Callable[[Any], torch.Tensor]) -> None:
        super().__init__()
        self.kept, self.unpack, self.next = kept, unpack, 0

    def __enter__(self) -> "_ReuseOutputs":
        self.next = 0  # each backward that reruns the layer (retain_graph=True) replays from the first
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func not in saved_ops():
            return func(*args, **(kwargs or {}))
        if self.next >= len(self.kept) or self.kept[self.next][0] is not func:
            raise _cp.CheckpointError(
                f"torch.utils.checkpoint: a selective recompute ran {func} where its forward ran "
                f"{self.kept[self.next][0] if self.next < len(self.kept) else 'nothing more to keep'}; the "
                "layer's forward must run the same ops when it is recomputed (no control flow on global state)."
            )
        _, spec, leaves, watched = self.kept[self.next]
        self.next += 1
        if any(counter._version != version for counter, version in watched):
            return func(*args, **(kwargs or {}))  # changed in place after it was kept: the op runs again
        return tree_unflatten([self.unpack(x).detach() if packed else x for packed, x in leaves], spec)


class _FreshBuffers:
    """``inner`` with clones of ``module``'s buffers in place (Note [Buffers in a recompute]); entered once
    per rerun (a retained graph reruns the layer in each backward)."""

    def __init__(self, module: nn.Module, inner: Any) -> None:
        self.module, self.inner, self.owned = module, inner, []

    def __enter__(self) -> None:
        self.owned = [(m, name, b) for m in self.module.modules() for name, b in m._buffers.items() if b is not None]
        for m, name, b in self.owned:
            m._buffers[name] = b.clone()
        try:
            self.inner.__enter__()
        except BaseException:
            self._restore()
            raise

    def __exit__(self, *exc: Any) -> None:
        try:
            self.inner.__exit__(*exc)
        finally:
            self._restore()

    def _restore(self) -> None:
        for m, name, b in self.owned:
            m._buffers[name] = b
        self.owned = []


@functools.cache
def saved_ops() -> frozenset:
    """The ops whose outputs a selective recompute keeps: matrix multiplies, convolutions, attention."""
    names = ("mm", "addmm", "bmm", "baddbmm", "convolution", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
             "_scaled_dot_product_flash_attention_for_cpu", "_flash_attention_forward", "_efficient_attention_forward")
    return frozenset(getattr(torch.ops.aten, n).default for n in names if hasattr(torch.ops.aten, n))


def selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> _cp.CheckpointPolicy:
    """Note [Selective recompute]: a layer recomputed selectively keeps, besides its input, the outputs of
    :func:`saved_ops` (most of its time) and reruns the rest (norms, activations, rotary embeddings, casts:
    most of its saved bytes) in backward, where the kept outputs replace those ops, so the results are a
    plain checkpoint's. The kept outputs are saved as the checkpoint's input is, through the saved-tensor
    hooks around it (in an offloaded layer they are offloaded, ``selective_offload``). An output changed in
    place after it was kept (``h = fc(x); h.mul_(2)``) is not handed back: its op runs again, as in a full
    recompute. In eager code :class:`_KeepOutputs` and :class:`_ReuseOutputs` do this (torch's selective
    checkpoint holds its cache where no hook sees it); traced code (Note [Traced layers]) takes torch's with
    this policy, and the compile pass offloads what it saves."""
    return _cp.CheckpointPolicy.MUST_SAVE if op in saved_ops() else _cp.CheckpointPolicy.PREFER_RECOMPUTE
