"""Free and restore a rank's accelerator memory (seed steps 37 and 41), and CPU weight backups.

Colocated with vLLM, the trainer must give the GPU back while the engines generate. `Offloader`
empties the *storages* behind parameters, fp32 master weights and optimizer state
(``untyped_storage().resize_(0)``) and brings them back in place: tensor objects, views into
DDP's flat buffers and the optimizer's references all stay valid. What is copied, and how:

- The fp32 masters and the Adam state go to pinned host buffers allocated once and reused (one at
  the first sleep; one more should the state grow), as asynchronous copies
  with one wait at the end (a pinned allocation and a blocking copy per tensor: 35–39 GB/s on the
  H100; now 40 GB/s out, the link's rate for the weight backup too).
- The bf16 parameters are not copied when a mixed-precision optimizer holds an fp32 master of
  each: they are its rounding (the optimizer writes them so after every step), so ``wake_up``
  rebuilds them on the device from the masters. 1.2 GB of the 0.6B shape's 8.4 GB each way.
- Gradient buffers are dropped, not copied: they are zeroed before every step anyway.
- ``sleep(keep_weights=True)`` (the loop's step 41) leaves the parameters where they are until
  ``drop_weights``, right after the weight push has read them on the device (a D2D pack instead of
  an H2D copy of the CPU backup); the drop then frees (or, without masters, copies) them as the
  full sleep would have, so the engines' KV cache, woken after the push, has the same room.
- ``wake_up`` first takes the parameters' size in one allocation and frees it, then the rest's, so
  the storages are carved from two cached segments rather than one ``cudaMalloc`` each (the sleep
  emptied the cache). On the H100 (0.6B shape, docs/benchmarks.md) sleep 0.178 s and wake 0.201 s
  with one segment, from 0.239 / 0.218. The parameters have a segment of their own so that a
  ``keep_weights`` sleep gives the other back whole: with one for everything, the kept parameters
  held all of it (13,832 MiB for 1.2 GB of weights in the H100's loop test, 12-07).
- On the GPU ``wake_up`` returns once the parameters are back: the optimizer's state (Adam's two
  moments, 8 of the 12 bytes copied per parameter) is copied on a side stream while the forward
  and backward passes run, and `state_ready` makes the compute stream wait for it (a GPU-side
  wait, no host sync). Whatever reads or writes the state calls it first: the optimizer step
  (`Passes`), a checkpoint save or load, the next sleep.

``sleep(offload=False)`` is the seed's ``clear_memory()`` of a trainer that is not offloaded
(``offload_train=false``): only what needs no copy is freed (gradients, parameters rebuilt from
their masters, the allocator's cache), and the masters and optimizer state stay on the device, so
neither direction copies anything. `check_room_for_engines` refuses it where that state would not
leave the engines their share of the GPU.

On CPU the same path runs (the copy goes to ordinary memory), which is what lets CPU tests show
that a sleep/wake cycle leaves results unchanged.

`WeightBackup` keeps named CPU copies of this rank's parameters: ``"actor"`` after each training
step (a weight push reads it while the model sleeps without its weights: a catch-up push to a
restarted engine, ``POST /v1/weights/push``) and ``"ref"`` (the reference policy for
the KL term).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch


def _storages(tensors: Iterable[torch.Tensor]) -> Iterator[torch.UntypedStorage]:
    seen: set[int] = set()
    for t in tensors:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if storage.nbytes() and key not in seen:
            seen.add(key)
            yield storage


def _chained(optimizer: object) -> list[Any]:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def optimizer_tensors(optimizer: object) -> Iterator[torch.Tensor]:
    """Master parameters and state tensors of a Megatron (possibly chained) optimizer."""
    for opt in _chained(optimizer):
        yield from (p for group in getattr(opt, "optimizer", opt).param_groups for p in group["params"])
    yield from optimizer_state(optimizer)


def optimizer_state(optimizer: object) -> Iterator[torch.Tensor]:
    """The state tensors (Adam's moments) of a Megatron (possibly chained) optimizer: what only its
    step reads."""
    for opt in _chained(optimizer):
        for state in getattr(opt, "optimizer", opt).state.values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))


def masters_of(optimizer: object) -> dict[int, torch.Tensor]:
    """The fp32 master of each model parameter a mixed-precision optimizer rebuilds from it, by the
    parameter's id (Megatron's ``float16_groups``); empty for an optimizer that steps the parameters
    themselves."""
    out: dict[int, torch.Tensor] = {}
    for opt in _chained(optimizer):
        if not hasattr(opt, "_copy_main_params_to_model_params"):
            continue
        for model_group, main_group in zip(
            getattr(opt, "float16_groups", []), getattr(opt, "fp32_from_float16_groups", []), strict=True
        ):
            out.update((id(p), main) for p, main in zip(model_group, main_group, strict=True))
    return out


def _bytes_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """The storage as a flat uint8 tensor (for a copy into a slice of the host buffer)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class Offloader:
    """Moves the bytes of a rank's training state to CPU and back, in place."""

    def __init__(self, model: torch.nn.Module, optimizer: object, device: str) -> None:
        self.model = model
        self.optimizer = optimizer
        self.device = torch.device(device)
        self._host: list[torch.Tensor] = []
        """The pinned (CPU: ordinary) buffers every sleep copies into: one at the first sleep, one
        more only when the state grows (an optimizer that creates its state at its first step)."""
        self._saved: list[tuple[torch.UntypedStorage, torch.Tensor]] = []
        """Storages copied to the host, each with its slice of a host buffer."""
        self._saved_state: list[tuple[torch.UntypedStorage, torch.Tensor]] = []
        """The same for the optimizer's state, which the wake-up copies back on a side stream."""
        self._stream: Any = None
        self._state_copied: Any = None
        """The CUDA event after the side stream's copies of the state, until `state_ready`."""
        self._dropped: list[tuple[torch.UntypedStorage, int]] = []
        """Storages freed without a copy (gradients, parameters rebuilt from masters), with their size."""
        self._rebuild = False
        self._held: list[tuple[torch.UntypedStorage, torch.Tensor | None]] = []
        """Parameter storages a ``keep_weights`` sleep left on the device for the weight push,
        each with its host slice (None: rebuilt from the masters, so only freed) until
        `drop_weights`."""
        self.asleep = False

    def _state(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(tensors whose bytes are copied, tensors only freed) on this device."""
        params = list(self.model.parameters())
        derived = masters_of(self.optimizer)
        self._rebuild = bool(derived) and all(id(p) in derived for p in params)
        kept = list(optimizer_tensors(self.optimizer))
        grads = [
            g
            for t in (*params, *kept)  # the masters' grads: views of DDP's buffer, or fp32 copies
            for g in (getattr(t, "main_grad", None), t.grad)
            if g is not None
        ]
        freed = grads
        if self._rebuild:
            freed = [*grads, *(p.data for p in params)]
        else:
            kept = [*(p.data for p in params), *kept]
        here = self.device.type  # one accelerator per rank: "cuda" and "cuda:0" alike
        return [t for t in kept if t.device.type == here], [t for t in freed if t.device.type == here]

    def _host_slices(self, sizes: list[int]) -> list[torch.Tensor]:
        """A slice of the host buffers for each size, in order; the same sizes get the same slices
        every sleep. What the buffers cannot hold goes to one new buffer for all the rest."""
        slices: list[torch.Tensor] = []
        buffer, offset = 0, 0
        for k, n in enumerate(sizes):
            while buffer < len(self._host) and offset + n > self._host[buffer].numel():
                buffer, offset = buffer + 1, 0
            if buffer == len(self._host):
                pin = self.device.type == "cuda"
                self._host.append(torch.empty(sum(sizes[k:]), dtype=torch.uint8, pin_memory=pin))
            slices.append(self._host[buffer][offset : offset + n])
            offset += n
        return slices

    @property
    def host_bytes(self) -> int:
        """Bytes of host memory the sleeps copy into (pinned on the GPU)."""
        return sum(h.numel() for h in self._host)

    def sleep(self, offload: bool = True, keep_weights: bool = False) -> int:
        """Free the device memory of parameters, grads and optimizer state; returns bytes freed.
        ``offload=False``: keep the masters and optimizer state on the device, copy nothing.
        ``keep_weights``: the parameters stay on the device, readable by the weight push, until
        `drop_weights` (which then does for them what this sleep would have done)."""
        if self.asleep:
            return 0
        self.state_ready()  # the state's last copies in land before it is read back out
        kept, freed_only = self._state()
        state_keys = {s.data_ptr() for s in _storages(optimizer_state(self.optimizer))}
        dropped = list(_storages(freed_only))
        dropped_keys = {s.data_ptr() for s in dropped}
        saved = [s for s in _storages(kept) if s.data_ptr() not in dropped_keys] if offload else []
        held = {s.data_ptr() for s in _storages(self.model.parameters())} if keep_weights else set()
        copied = []
        for storage, host in zip(saved, self._host_slices([s.nbytes() for s in saved]), strict=True):
            if storage.data_ptr() in held:
                self._held.append((storage, host))  # the same slice a full sleep would use
                continue
            host.copy_(_bytes_view(storage), non_blocking=True)
            copied.append((storage, host))
        self._held += [(s, None) for s in dropped if s.data_ptr() in held]
        if self.device.type == "cuda":
            torch.cuda.synchronize()  # the copies are done before their storages are freed
        self._saved += [(s, h) for s, h in copied if s.data_ptr() not in state_keys]
        self._saved_state += [(s, h) for s, h in copied if s.data_ptr() in state_keys]
        self.asleep = True
        return self._free([s for s, _ in copied], [s for s in dropped if s.data_ptr() not in held])

    @property
    def weights_resident(self) -> bool:
        """The parameters' bytes are on the device (awake, held by a ``keep_weights`` sleep, or
        never moved: ``offload=False`` without masters)."""
        return all(p.untyped_storage().nbytes() for p in self.model.parameters())

    def drop_weights(self) -> int:
        """Free the parameters a ``keep_weights`` sleep kept (copying those without masters to
        their host slice first); returns bytes freed (0 when none are held)."""
        if not self._held:
            return 0
        held, self._held = self._held, []
        copied = [(s, h) for s, h in held if h is not None]
        for storage, host in copied:
            host.copy_(_bytes_view(storage), non_blocking=True)
        if copied and self.device.type == "cuda":
            torch.cuda.synchronize()
        self._saved += copied
        return self._free([s for s, _ in copied], [s for s, h in held if h is None])

    def _free(self, copied: list[torch.UntypedStorage], dropped: list[torch.UntypedStorage]) -> int:
        """Free storages whose bytes are on the host (``copied``) or need none (``dropped``, kept
        with their size for the wake-up); give the allocator's cache back. Bytes freed."""
        freed = sum(s.nbytes() for s in copied)
        for storage in copied:
            storage.resize_(0)
        for storage in dropped:
            self._dropped.append((storage, storage.nbytes()))
            freed += storage.nbytes()
            storage.resize_(0)
        if self.device.type == "cuda":
            # cuBLAS keeps a workspace per handle and stream in the allocator; the engines want it
            clear_cublas = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
            if clear_cublas is not None:
                clear_cublas()
            torch.cuda.empty_cache()
        return freed

    def wake_up(self) -> None:
        """Bring everything back where it was (grads come back zeroed); on the GPU the optimizer's
        state may still be on its way in (`state_ready`)."""
        if not self.asleep:
            return
        self.drop_weights()  # weights still held come back the one way everything else does
        cuda = self.device.type == "cuda"
        sizes = [(s, h.numel()) for s, h in (*self._saved, *self._saved_state)] + self._dropped
        params = {p.untyped_storage()._cdata for p in self.model.parameters()}
        for part in (
            [x for x in sizes if x[0]._cdata in params],
            [x for x in sizes if x[0]._cdata not in params],
        ):
            if cuda:  # the parameters' own segment: a keep_weights sleep must free all the others
                _reserve_one_segment([n for _, n in part], self.device)
            for storage, n in part:
                storage.resize_(n)
        for storage, host in self._saved:
            _bytes_view(storage).copy_(host, non_blocking=True)
        self._copy_state_in()
        if self._rebuild:
            with torch.no_grad():
                for opt in _chained(self.optimizer):
                    if hasattr(opt, "_copy_main_params_to_model_params"):
                        opt._copy_main_params_to_model_params()
        zero_grads = getattr(self.model, "zero_grad_buffer", None)
        if zero_grads is not None:
            zero_grads()
        if cuda:
            torch.cuda.current_stream(self.device).synchronize()  # not the side stream's copies
        self._saved.clear()
        self._saved_state.clear()
        self._dropped.clear()
        self.asleep = False

    def _copy_state_in(self) -> None:
        """The state's host → device copies; on the GPU on a side stream, after what the compute
        stream has queued (the storages were just allocated on it), and an event marks their end."""
        if self.device.type != "cuda" or not self._saved_state:
            for storage, host in self._saved_state:
                _bytes_view(storage).copy_(host)
            return
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            for storage, host in self._saved_state:
                _bytes_view(storage).copy_(host, non_blocking=True)
            self._state_copied = torch.cuda.Event()
            self._state_copied.record(self._stream)

    def state_ready(self) -> None:
        """Make the compute stream wait for the optimizer's state to be back (a GPU-side wait; a
        no-op when nothing is on its way). Call before anything reads or writes the state."""
        if self._state_copied is not None:
            torch.cuda.current_stream(self.device).wait_event(self._state_copied)
            self._state_copied = None


def check_room_for_engines(device: str, engine_fraction: float) -> None:
    """Raise when what this process keeps on ``device`` exceeds what ``engine.gpu_memory_utilization``
    leaves beside the engines (the optimizer's state exists from the start: `init_adam_state`)."""
    total = torch.cuda.get_device_properties(device).total_memory
    held = torch.cuda.memory_reserved(device)
    room = (1.0 - engine_fraction) * total
    if held > room:
        gib = 1 << 30
        raise MemoryError(
            f"offload_train=false keeps {held / gib:.1f} GiB of training state on {device} while the "
            f"engines run, but engine.gpu_memory_utilization={engine_fraction} leaves the trainer "
            f"{room / gib:.1f} GiB of its {total / gib:.1f} GiB: set offload_train=true (the state "
            "then waits in host memory) or lower engine.gpu_memory_utilization"
        )


LARGE_BLOCK = 1 << 20
"""The caching allocator serves requests above 1 MiB from its large pool, in 512-byte steps."""


def _reserve_one_segment(sizes: list[int], device: torch.device) -> None:
    """Allocate and free the large requests' total at once: the allocator keeps the segment and
    splits it for the requests that follow, instead of a ``cudaMalloc`` per request."""
    total = sum(-(-n // 512) * 512 for n in sizes if n > LARGE_BLOCK)
    if total:
        torch.empty(total, dtype=torch.uint8, device=device)  # freed at once, the segment kept


class WeightBackup:
    """Named CPU copies of this rank's parameters."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._copies: dict[str, dict[str, torch.Tensor]] = {}

    def _named(self) -> dict[str, torch.nn.Parameter]:
        inner = getattr(self.model, "module", self.model)
        return dict(inner.named_parameters())

    def backup(self, tag: str) -> None:
        """Copy the current parameters to CPU under ``tag`` (reusing the buffers of an earlier copy)."""
        copies = self._copies.setdefault(tag, {})
        pin = torch.cuda.is_available()
        with torch.no_grad():
            for name, p in self._named().items():
                dst = copies.get(name)
                if dst is None:
                    dst = torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=pin)
                    copies[name] = dst
                dst.copy_(p.detach(), non_blocking=pin)
        if pin:
            torch.cuda.synchronize()

    def restore(self, tag: str) -> None:
        """Copy the parameters saved under ``tag`` back into the model."""
        copies = self.get(tag)
        with torch.no_grad():
            for name, p in self._named().items():
                p.copy_(copies[name], non_blocking=True)

    def get(self, tag: str) -> dict[str, torch.Tensor]:
        if tag not in self._copies:
            raise KeyError(f"no weight backup {tag!r} (have {sorted(self._copies)})")
        return self._copies[tag]

    def has(self, tag: str) -> bool:
        return tag in self._copies
