"""Free and restore a rank's accelerator memory (seed steps 37 and 41), and CPU weight backups.

Colocated with vLLM, the trainer must give the GPU back while the engines generate. `Offloader`
empties the *storages* behind parameters, fp32 master weights and optimizer state
(``untyped_storage().resize_(0)`` after copying them to pinned CPU memory) and simply drops the
gradient buffers, which are zeroed before every step anyway. Tensor objects, views into DDP's
flat buffers and the optimizer's references all stay valid, so ``wake_up`` only resizes the
storages back and copies the bytes in. On CPU the same path runs (the copy goes to ordinary
memory), which is what lets CPU tests show that a sleep/wake cycle leaves results unchanged.

`WeightBackup` keeps named CPU copies of this rank's parameters: ``"actor"`` after each training
step (the weight push reads it while the model sleeps) and ``"ref"`` (the reference policy for
the KL term).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch


def _storages(tensors: Iterable[torch.Tensor]) -> Iterator[torch.UntypedStorage]:
    seen: set[int] = set()
    for t in tensors:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if storage.nbytes() and key not in seen:
            seen.add(key)
            yield storage


def optimizer_tensors(optimizer: object) -> Iterator[torch.Tensor]:
    """Master parameters and state tensors of a Megatron (possibly chained) optimizer."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", opt)
        for group in inner.param_groups:
            yield from group["params"]
        for state in inner.state.values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))


class Offloader:
    """Moves the bytes of a rank's training state to CPU and back, in place."""

    def __init__(self, model: torch.nn.Module, optimizer: object, device: str) -> None:
        self.model = model
        self.optimizer = optimizer
        self.device = torch.device(device)
        self._saved: list[tuple[torch.UntypedStorage, torch.UntypedStorage]] = []
        self._dropped: list[tuple[torch.UntypedStorage, int]] = []
        self.asleep = False

    def _state(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        params = [p.data for p in self.model.parameters()]
        grads = [
            g
            for p in self.model.parameters()
            for g in (getattr(p, "main_grad", None), p.grad)
            if g is not None
        ]
        kept = [*params, *(t for t in optimizer_tensors(self.optimizer))]
        on_device = [t for t in kept if t.device == self.device]
        return on_device, [g for g in grads if g.device == self.device]

    def sleep(self) -> int:
        """Free the device memory of parameters, grads and optimizer state; returns bytes freed."""
        if self.asleep:
            return 0
        kept, grads = self._state()
        pin = self.device.type == "cuda"
        freed = 0
        grad_keys = {s.data_ptr() for s in _storages(grads)}
        for storage in _storages(kept):
            if storage.data_ptr() in grad_keys:
                continue
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, device="cpu", pin_memory=pin)
            backup = host.untyped_storage()
            backup.copy_(storage)
            self._saved.append((storage, backup))
            freed += storage.nbytes()
            storage.resize_(0)
        for storage in _storages(grads):
            self._dropped.append((storage, storage.nbytes()))
            freed += storage.nbytes()
            storage.resize_(0)
        if pin:
            torch.cuda.synchronize()
            # cuBLAS keeps a workspace per handle and stream in the allocator; the engines want it
            clear_cublas = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
            if clear_cublas is not None:
                clear_cublas()
            torch.cuda.empty_cache()
        self.asleep = True
        return freed

    def wake_up(self) -> None:
        """Bring everything back where it was (grads come back zeroed)."""
        if not self.asleep:
            return
        for storage, backup in self._saved:
            storage.resize_(backup.nbytes())
            storage.copy_(backup, non_blocking=True)
        for storage, nbytes in self._dropped:
            storage.resize_(nbytes)
        zero_grads = getattr(self.model, "zero_grad_buffer", None)
        if zero_grads is not None:
            zero_grads()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self._saved.clear()
        self._dropped.clear()
        self.asleep = False


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
