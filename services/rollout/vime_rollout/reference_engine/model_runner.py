"""The Hugging Face model on CPU: batched forward passes over the slot KV cache, and its memory.

The model is a transformers causal LM in fp32 (or the ``dtype`` asked for, as vLLM's ``--dtype``).
A pass computes any mix of prefills and decodes in one call: row ``i`` feeds its new tokens at
positions ``start_i, start_i + 1, ...`` (right padded to the longest row), keys/values land in the
row's slot of `SlotKVCache`, and the logits at each row's last real token come back. The decoder
is called with a prepared attention-mask mapping (transformers 5 skips its own mask building when
given one), so any decoder that follows that convention works: Qwen2/3, Llama, Mistral.

Sleep mirrors vLLM's levels: level 1 keeps the weights aside as a CPU backup (on CPU that backup
is the tensors themselves) and drops the KV cache; level 2 drops both. Waking ``weights`` after
level 2 re-creates zero-filled parameters that a weight update must fill, as vLLM re-maps empty
memory. Buffers (rotary tables) are never dropped, as vLLM keeps them too.
"""

from __future__ import annotations

import contextlib
import ctypes
import inspect
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .kv_cache import SlotKVCache

log = logging.getLogger("vime.reference_engine")


@dataclass(frozen=True)
class ParamSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype


def _release_freed_memory() -> None:
    """Ask glibc to return freed heap pages to the OS so that a sleep shows in the RSS."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to trim
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _load_eos_ids(model_dir: Path, config: Any) -> set[int]:
    ids: set[int] = set()
    candidates: list[Any] = [getattr(config, "eos_token_id", None)]
    try:
        from transformers import GenerationConfig

        candidates.append(GenerationConfig.from_pretrained(str(model_dir)).eos_token_id)
    except (OSError, ValueError):
        pass
    for c in candidates:
        if isinstance(c, int):
            ids.add(c)
        elif isinstance(c, list | tuple):
            ids.update(int(x) for x in c)
    return ids


class ModelRunner:
    """Owns the model's weights and KV cache; every method runs with the engine lock held."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        max_slots: int,
        max_model_len: int | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        self.model_dir = Path(model_dir)
        config = AutoConfig.from_pretrained(str(self.model_dir))
        self.config = config
        model = AutoModelForCausalLM.from_pretrained(str(self.model_dir), dtype=dtype)
        self.model = model.eval()
        self.decoder = model.get_decoder()
        self.lm_head = model.get_output_embeddings()
        self._cache_kwarg = (
            "cache" if "cache" in inspect.signature(self.decoder.forward).parameters else "past_key_values"
        )
        self.vocab_size = int(config.vocab_size)
        limit = int(getattr(config, "max_position_embeddings", 0) or 0) or 4096
        self.max_model_len = int(max_model_len or limit)
        self.eos_ids = _load_eos_ids(self.model_dir, config)
        self.layer_types = sorted(set(getattr(config, "layer_types", None) or ["full_attention"]))
        self.params: dict[str, torch.nn.Parameter] = dict(model.named_parameters(remove_duplicate=False))
        self.specs = {n: ParamSpec(tuple(p.shape), p.dtype) for n, p in self.params.items()}
        self._unique = dict(model.named_parameters())
        self._backup: dict[str, torch.Tensor] | None = None
        self.weights_resident = True
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        self.kv = SlotKVCache(
            int(config.num_hidden_layers),
            int(config.num_key_value_heads),
            head_dim,
            dtype=dtype,
            max_slots=max_slots,
            max_len=self.max_model_len,
        )

    # ----- forward ---------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, row_start: int, tokens: list[list[int]], starts: list[int]) -> torch.Tensor:
        """Feed ``tokens[i]`` at positions ``starts[i]...`` into slot ``row_start + i``; last-token logits."""
        batch = len(tokens)
        width = max(len(t) for t in tokens)
        ids = torch.zeros(batch, width, dtype=torch.long)
        for i, row in enumerate(tokens):
            ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        positions = torch.tensor(starts, dtype=torch.long).unsqueeze(1) + torch.arange(width).unsqueeze(0)
        kv_len = int(positions.max()) + 1
        self.kv.ensure(row_start + batch, kv_len)
        self.kv.bind(row_start, positions, kv_len)
        visible = torch.arange(kv_len).view(1, 1, 1, kv_len) <= positions.view(batch, 1, width, 1)
        masks = dict.fromkeys(self.layer_types, visible)
        out = self.decoder(
            input_ids=ids,
            position_ids=positions,
            attention_mask=masks,
            use_cache=True,
            **{self._cache_kwarg: self.kv},
        )
        last = torch.tensor([len(t) - 1 for t in tokens], dtype=torch.long)
        hidden = out.last_hidden_state[torch.arange(batch), last]
        return self.lm_head(hidden).float()

    # ----- sleep / wake ----------------------------------------------------------------------

    def free_kv_cache(self) -> None:
        """Discard the KV cache (its contents are not kept, as in vLLM)."""
        self.kv.free()
        _release_freed_memory()

    def sleep_weights(self, level: int) -> None:
        """Level 1: set the weights aside (backup); level 2: drop them."""
        if not self.weights_resident:
            return
        backup: dict[str, torch.Tensor] = {}
        for name, param in self._unique.items():
            if level == 1:
                backup[name] = param.data
            param.data = torch.empty(0, dtype=param.dtype)
        self._backup = backup if level == 1 else None
        self.weights_resident = False
        _release_freed_memory()

    def wake_weights(self) -> None:
        """Restore the level-1 backup, or re-create zero-filled parameters after level 2."""
        if self.weights_resident:
            return
        for name, param in self._unique.items():
            if self._backup is not None:
                param.data = self._backup[name]
            else:
                spec = self.specs[name]
                param.data = torch.zeros(spec.shape, dtype=spec.dtype)
        self._backup = None
        self.weights_resident = True

    # ----- weight updates --------------------------------------------------------------------

    def check_tensors(self, shapes: dict[str, tuple[int, ...]]) -> None:
        """Raise ValueError naming every unknown parameter and every wrong shape."""
        unknown = sorted(n for n in shapes if n not in self.specs)
        wrong = sorted(
            f"{n} {list(s)} (expected {list(self.specs[n].shape)})"
            for n, s in shapes.items()
            if n in self.specs and tuple(s) != self.specs[n].shape
        )
        problems = []
        if unknown:
            problems.append(f"unknown parameter names: {', '.join(unknown)}")
        if wrong:
            problems.append(f"wrong shapes: {', '.join(wrong)}")
        if problems:
            raise ValueError("; ".join(problems))

    @torch.inference_mode()
    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy already-checked HF-named tensors into the parameters (converted to the model dtype)."""
        for name, tensor in tensors.items():
            param = self.params[name]
            param.data.copy_(tensor.to(param.dtype))

    # ----- accounting ------------------------------------------------------------------------

    def weights_nbytes(self) -> int:
        return sum(p.data.numel() * p.data.element_size() for p in self._unique.values())

    def backup_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self._backup or {}).values())

    def total_weight_nbytes(self) -> int:
        return sum(
            torch.Size(s.shape).numel() * torch.empty(0, dtype=s.dtype).element_size()
            for n, s in self.specs.items()
            if n in self._unique
        )
