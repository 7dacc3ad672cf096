"""Tiled MLP and offloaded activation checkpoints: what lets one rank's share of a long sequence
fit after sequence parallelism has cut it.

**Tiled MLP** (``trainer.tiled_mlp``). A decoder layer's MLP is token-wise, and its backward
holds three tokens × intermediate tensors at once (18,944 wide on Qwen2.5-7B: 2.3 GB in bf16
for 32k tokens). Tiled, the forward runs the MLP tile by tile without autograd and keeps only
its input; the backward recomputes one tile at a time and backpropagates through it, so only
one tile's intermediates ever exist. A tile is ``hidden_size`` tokens (as in DeepSpeed's ALST:
a tile's intermediate is then the size of one MLP weight matrix).

Two things the anchors' versions get wrong with LoRA, done here:

- The LoRA weights of gate/up/down *are* the trainable parameters of the tiled computation.
  Their gradient accumulates over the tiles, and ZeRO must not reduce it before the last tile:
  each of them is flagged ``ds_grad_is_ready`` = False until then (the flag ZeRO-2 and ZeRO-3
  read in their gradient hooks).
- Under ZeRO-3 every tile's forward gathers the MLP's partitioned weights (module hooks), so
  every rank must run the same number of tiles whatever its batch's width: the count comes
  from the config (``tiles_for``), and ``tensor_split`` always gives exactly that many (some
  may be empty).

**Offloaded checkpoints** (``trainer.offload_activations``). With activation checkpointing a
recomputed layer keeps only its input, ``tokens × hidden`` per layer, which at long sequences
is most of what is left (28 layers × 32k × 3584 × 2 bytes = 6.1 GiB on Qwen2.5-7B). Offloaded,
that input is copied to host memory (pinned, on a side stream, so it overlaps the next
layer's forward on CUDA) and copied back before the layer's backward recomputes it — the copy
for the layer below is started first, so it overlaps this layer's recompute. On CPU ranks it
is the same code path with a plain host copy (the tests check values, not speed).

Both are autograd functions that backpropagate through their recompute with
``torch.autograd.backward`` (as reentrant checkpointing does): the RNG state is restored for
the recompute so LoRA dropout draws the same mask. The checkpoint one also serves
trainer.compile with the input left on the device (:func:`compiled_checkpoints`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn

from memtune.rank.layers import SelectiveCheckpoint, decoder_layers
from memtune.rank.telemetry import count_host_offload

# --- tiled MLP --------------------------------------------------------------------------------


def tiles_for(tokens: int, hidden_size: int) -> int:
    """Tiles of a rank's ``tokens`` (micro batch × its share of max_seq_len): one per
    ``hidden_size`` tokens."""
    return max(1, math.ceil(tokens / hidden_size))


def by_tiles(mlp: nn.Module, run: Callable, x: torch.Tensor, tiles: int) -> torch.Tensor:
    """``run(mlp, ·)`` over exactly ``tiles`` tiles of the flattened tokens of ``x``."""
    flat = x.reshape(-1, x.shape[-1])
    out = torch.cat([run(mlp, t) for t in flat.tensor_split(tiles)], dim=0)
    return out.view(*x.shape[:-1], out.shape[-1])


class TiledMLP(torch.autograd.Function):
    """``mlp(x)`` over ``tiles`` tiles of the flattened tokens of ``x``, recomputed tile by
    tile in backward."""

    @staticmethod
    def forward(
        ctx: Any, mlp: nn.Module, run: Callable, x: torch.Tensor, tiles: int, trainable: list
    ) -> torch.Tensor:
        ctx.mlp, ctx.run, ctx.tiles, ctx.trainable = mlp, run, tiles, trainable
        ctx.rng = _rng_state(x.device)
        ctx.save_for_backward(x)
        with torch.no_grad():
            return by_tiles(mlp, run, x, tiles)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        (x,) = ctx.saved_tensors
        flat = x.detach().reshape(-1, x.shape[-1])
        grads = grad.reshape(-1, grad.shape[-1]).tensor_split(ctx.tiles)
        want_x = ctx.needs_input_grad[2]
        x_grad = torch.empty_like(flat) if want_x else None
        at = 0
        with _restored_rng(ctx.rng, x.device):
            for i, (tile, g) in enumerate(zip(flat.tensor_split(ctx.tiles), grads, strict=True)):
                last = i == ctx.tiles - 1
                for p in ctx.trainable:  # ZeRO reduces a gradient only once it is complete
                    p.ds_grad_is_ready = last
                tile = tile.detach().requires_grad_(want_x)
                with torch.enable_grad():
                    out = ctx.run(ctx.mlp, tile)
                torch.autograd.backward(out, g)
                if x_grad is not None and tile.grad is not None:
                    x_grad[at : at + tile.shape[0]] = tile.grad
                at += tile.shape[0]
        return None, None, None if x_grad is None else x_grad.view_as(x), None, None


def tile_mlps(model: Any, tokens: int) -> int:
    """Make every decoder layer's MLP tiled for ``tokens`` tokens per micro batch on this rank;
    returns the number of tiles."""
    layers = decoder_layers(model)
    hidden = int(model.config.hidden_size)
    tiles = tiles_for(tokens, hidden)
    for layer in layers:
        _tile(layer.mlp, tiles)
    return tiles


def untile_mlps(model: Any) -> int:
    """Every decoder layer's MLP back to its own forward (decisions without tiles applied to
    a model that had them: rank.build.apply_layer_decisions); returns 0, the tiles now."""
    for layer in decoder_layers(model):
        layer.mlp.__dict__.pop("forward", None)  # the instance's tiled forward, if any
    return 0


def _plain_forward(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The MLP's own forward, read from its class when called: the fused one when rank.kernels
    has given the MLP its fused class, before or after the tiles."""
    out: torch.Tensor = type(mlp).forward(mlp, x)
    return out


def _tile(mlp: nn.Module, tiles: int) -> None:
    plain = _plain_forward
    trainable = [p for p in mlp.parameters() if p.requires_grad]

    def forward(x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return by_tiles(mlp, plain, x, tiles)
        return TiledMLP.apply(mlp, plain, x, tiles, trainable)

    mlp.forward = forward


# --- offloaded activation checkpoints -----------------------------------------------------


class HostBuffer:
    """Host memory for one offloaded layer input, kept and reused from step to step, exactly
    the bytes it holds: on a CUDA rank page-locked in place (``cudaHostRegister`` over a plain
    CPU tensor, as DeepSpeed's accelerator registers host memory). torch's pinned allocator
    (``torch.empty(..., pin_memory=True)``) would round each block up to a power of two and
    cache it (ATen's CachingHostAllocator: ``PowerOf2Ceil``): +14% for Qwen2.5-7B's hidden
    width at a power-of-two token count, +24% at 60,416 tokens, up to 2×, and a block per size
    class where widths vary from step to step, none of it in the plan's host row."""

    def __init__(self, nbytes: int, pin: bool):
        self.data = torch.empty(nbytes, dtype=torch.uint8)
        self.pinned = False
        if pin and nbytes:
            cudart = torch.cuda.cudart()
            torch.cuda.check_error(int(cudart.cudaHostRegister(self.data.data_ptr(), nbytes, 0)))
            self.pinned = True
        self.counted = nbytes
        count_host_offload(nbytes)  # the rank's memory.json: peak_host_offload_gib

    def holding(self, like: torch.Tensor) -> torch.Tensor:
        """A view of the buffer shaped and typed as ``like``."""
        nbytes = like.numel() * like.element_size()
        return self.data[:nbytes].view(like.dtype).view(like.shape)

    def release(self) -> None:
        """Unlock the pages (before the tensor's memory goes back to the host's allocator)."""
        count_host_offload(-self.counted)
        self.counted = 0
        if self.pinned:
            self.pinned = False
            torch.cuda.check_error(
                int(torch.cuda.cudart().cudaHostUnregister(self.data.data_ptr()))
            )

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at exit CUDA may be gone; the process ends
            self.release()


class HostCopies:
    """The offloaded layer inputs of the current forward, in order, and the copy back of the
    next one the backward will need (started one layer ahead). Each input goes into its
    layer's :class:`HostBuffer`, made on the first step and grown only for a wider batch: the
    host holds the plan's row, layers × tokens × hidden, however many steps run."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self.buffers: list[HostBuffer] = []
        self.host: list[torch.Tensor] = []
        self.fetched: dict[int, tuple[torch.Tensor, Any]] = {}

    def _buffer(self, i: int, nbytes: int) -> HostBuffer:
        if i < len(self.buffers) and self.buffers[i].data.numel() >= nbytes:
            return self.buffers[i]
        if i < len(self.buffers):  # a wider batch: the old one may still feed a copy back
            if self.copy_stream is not None:
                self.copy_stream.synchronize()
            self.buffers[i].release()
            self.buffers[i] = HostBuffer(nbytes, self.cuda)
        else:
            self.buffers.append(HostBuffer(nbytes, self.cuda))
        return self.buffers[i]

    def put(self, x: torch.Tensor) -> int:
        """Start copying ``x`` to host memory; its index for :meth:`take`."""
        i = len(self.host)
        host = self._buffer(i, x.numel() * x.element_size()).holding(x)
        if self.cuda:
            assert self.copy_stream is not None
            # the copy stream also ran the last step's copies back out of this buffer
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.copy_stream):
                host.copy_(x, non_blocking=True)
            x.record_stream(self.copy_stream)  # x may be freed only once the copy is done
        else:
            host.copy_(x.detach())
        self.host.append(host)
        return i

    def release(self) -> None:
        """Unlock and drop the buffers (the layers no longer offload)."""
        if self.copy_stream is not None:
            self.copy_stream.synchronize()
        for buffer in self.buffers:
            buffer.release()
        self.buffers.clear()
        self.host.clear()
        self.fetched.clear()

    def _fetch(self, i: int) -> None:
        if i < 0 or i in self.fetched or i >= len(self.host):
            return
        host = self.host[i]
        if self.cuda:
            assert self.copy_stream is not None
            # Allocated on the compute stream, which frees it: the caching allocator keeps a
            # pool per stream, and inputs allocated on the copy stream would hold blocks the
            # compute stream cannot reuse. The copy waits for the work queued before it,
            # which may still be using the block's last tenant.
            compute = torch.cuda.current_stream(self.device)
            back = torch.empty(host.shape, dtype=host.dtype, device=self.device)
            self.copy_stream.wait_stream(compute)
            with torch.cuda.stream(self.copy_stream):
                back.copy_(host, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.copy_stream)
            self.fetched[i] = (back, event)
        else:  # the buffer itself: read by this backward, written again by the next forward
            self.fetched[i] = (host, None)

    def take(self, i: int) -> torch.Tensor:
        """Layer ``i``'s input back on the device; the copy for layer ``i - 1`` starts now."""
        self._fetch(i)
        back, event = self.fetched.pop(i)
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
        self._fetch(i - 1)
        if i == 0:
            self.host.clear()  # the backward is done with this forward's inputs
        return back


class LayerCheckpoint(torch.autograd.Function):
    """A checkpointed layer: its input waits until the backward recomputes the layer — in host
    memory (``copies``: offloaded) or, with ``copies=None``, on the device as
    ``torch.utils.checkpoint`` keeps it. The second form exists for trainer.compile:
    ``torch.utils.checkpoint`` runs its function with dynamo disabled, so a compiled layer
    inside it runs eager; inside this function the layer's compiled forward runs compiled, in
    the forward (no grad) and in the recompute."""

    @staticmethod
    def forward(
        ctx: Any,
        run: Callable,
        copies: HostCopies | None,
        x: torch.Tensor,
        _grad_anchor: torch.Tensor,
    ) -> torch.Tensor:
        ctx.run, ctx.copies = run, copies
        if copies is None:
            ctx.save_for_backward(x)
        else:
            ctx.index = copies.put(x)
        ctx.x_requires_grad = x.requires_grad
        ctx.rng = _rng_state(x.device)
        with torch.no_grad():
            return run(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        kept = ctx.saved_tensors[0] if ctx.copies is None else ctx.copies.take(ctx.index)
        x = kept.detach().requires_grad_(ctx.x_requires_grad)
        with _restored_rng(ctx.rng, x.device), torch.enable_grad():
            out = ctx.run(x)
        _release_values(out)
        torch.autograd.backward(out, grad)
        return None, None, x.grad if ctx.x_requires_grad else None, None


def _release_values(out: torch.Tensor) -> None:
    """Free the recomputed layer output's values before backpropagating through it: the
    backward needs only its graph, and a decoder layer ends in the residual sum, whose
    backward reads no values; held by this frame, the output would take tokens × hidden for
    the whole layer's backward (the 49k-token census of 2026-12-04 found it live at the peak:
    the residual sum's line). An output of any other op is left alone."""
    if isinstance(out, torch.Tensor) and type(out.grad_fn).__name__ == "AddBackward0":
        out.untyped_storage().resize_(0)


def offload_checkpoints(model: nn.Module, device: torch.device) -> int:
    """Checkpointed decoder layers keep their input in host memory (the decisions chose which
    layers checkpoint); returns how many layers offload."""
    return _own_checkpoints(model, HostCopies(device))


def keep_inputs_on_device(model: nn.Module) -> int:
    """Undo :func:`offload_checkpoints`: every layer that offloads gets back the checkpoint
    function it had before (decisions without offload applied to a model that had it:
    rank.build.apply_layer_decisions); compiled checkpoints stay. Returns 0, the layers now
    offloading."""
    for layer in decoder_layers(model):
        own = getattr(layer, "_gradient_checkpointing_func", None)
        if isinstance(own, OwnCheckpoint) and own.copies is not None:
            own.copies.release()
            layer._gradient_checkpointing_func = own.replaces
    return 0


def compiled_checkpoints(model: nn.Module) -> int:
    """trainer.compile for the checkpointed decoder layers: each recomputes through
    :class:`LayerCheckpoint`, its input kept on the device (the memory ``torch.utils.checkpoint``
    takes), and what the checkpoint runs — the layer's own forward, in the forward pass and in
    the recompute — is ``torch.compile``d (one compiled function for all layers, dynamic
    shapes); returns how many layers checkpoint."""
    return _own_checkpoints(model, None, compile_forward=True)


def _own_checkpoints(
    model: nn.Module, copies: HostCopies | None, compile_forward: bool = False
) -> int:
    """Route every checkpointed decoder layer through :class:`LayerCheckpoint`. transformers'
    layer wrapper hands the checkpoint ``partial(forward, layer, **kwargs)``, the unwrapped
    forward; with ``compile_forward``, that forward is swapped for its compiled form (one per layer
    class, compiled on first use)."""
    # Makes the output require grad even when the layer's input does not (the first layer's
    # input is the frozen embedding's output), so the backward reaches the layer's LoRA.
    anchor = torch.ones((), requires_grad=True)
    compiled: dict[Callable, Callable] = {}
    layers = [
        layer
        for layer in decoder_layers(model)
        if layer.gradient_checkpointing
        and not isinstance(layer._gradient_checkpointing_func, SelectiveCheckpoint)
    ]  # the layers recomputed in full (selective ones keep torch's selective checkpoint)
    for layer in layers:
        before = layer._gradient_checkpointing_func
        while isinstance(before, OwnCheckpoint):  # applied again: replace, never stack
            before = before.replaces
        layer._gradient_checkpointing_func = OwnCheckpoint(
            copies, compiled if compile_forward else None, anchor, before
        )
    return len(layers)


class OwnCheckpoint:
    """What a checkpointed decoder layer calls in place of transformers' checkpoint function
    (``_gradient_checkpointing_func``): :class:`LayerCheckpoint` with the input offloaded
    (``copies``) or compiled (``compiled``: one compiled function per layer class, shared), and
    the function it replaced, so that it can be undone (:func:`keep_inputs_on_device`)."""

    def __init__(
        self,
        copies: HostCopies | None,
        compiled: dict[Callable, Callable] | None,
        anchor: torch.Tensor,
        replaces: Callable,
    ):
        self.copies, self.compiled, self.anchor, self.replaces = copies, compiled, anchor, replaces

    def __call__(self, function: Callable, x: torch.Tensor, *args: Any) -> torch.Tensor:
        if args:
            raise ValueError("memtune's layer checkpoints take the hidden states only")
        if self.compiled is not None:
            if not isinstance(function, partial):
                raise TypeError(
                    "trainer.compile expects transformers to checkpoint a partial of the "
                    f"layer's forward, got {function!r}"
                )
            if function.func not in self.compiled:
                # fallback_random: dropout from torch's RNG, which LayerCheckpoint restores
                # for the recompute (inductor's own RNG would draw new masks).
                self.compiled[function.func] = torch.compile(
                    function.func, dynamic=True, options={"fallback_random": True}
                )
            compiled = self.compiled[function.func]
            function = partial(compiled, *function.args, **function.keywords)
        if not torch.is_grad_enabled():
            # a forward without a backward (preference.reference=live's reference pass in
            # training mode): nothing to keep, and nothing put in host memory it would never take
            return function(x)
        return LayerCheckpoint.apply(function, self.copies, x, self.anchor)


# --- RNG for the recompute ----------------------------------------------------------------


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


class _restored_rng:
    """Run a recompute with the RNG state of the forward, then put the current one back."""

    def __init__(self, state: tuple[torch.Tensor, torch.Tensor | None], device: torch.device):
        self.state, self.device = state, device

    def __enter__(self) -> None:
        self.saved = _rng_state(self.device)
        torch.set_rng_state(self.state[0])
        if self.state[1] is not None:
            torch.cuda.set_rng_state(self.state[1], self.device)

    def __exit__(self, *exc: object) -> None:
        torch.set_rng_state(self.saved[0])
        if self.saved[1] is not None:
            torch.cuda.set_rng_state(self.saved[1], self.device)
