"""Memory accounting: the bytes a forest will hold, known before it runs.

A request that needs more memory than the machine has must get an answer from the library (run
in waves, wait its turn, or a clear refusal), never a kill by the operating system. Everything a
forest holds grows with numbers known before the first forward:

- **KV bytes per token**: one cache slot, the keys and values of every layer.
- **slots** of a group of branches: its prompt tokens, each branch's new tokens and draft room.
- **visibility rows**: the forest keeps one boolean row over the slots per leaf (`Forest`), so w
  branches over S slots hold w*S bytes. This term grows with the square of the width: a group of
  100,000 branches is out of reach at once whatever the cache costs.
- **a step's logits**: every branch (and draft node) gets a float32 row over the vocabulary,
  held up to three times while the step's rows are gathered and chosen from; **per branch** bookkeeping (its sampler, its
  output, Python objects) adds a few kilobytes.
- **forward scratch**: a forward's masks, attention scores and activations grow with its rows
  times its slots. The engine cuts a wide forward, a long prompt's too, into pieces
  (`Footprint.rows_per_forward`) so that the scratch stays under `forward_bytes` (`FORWARD_BYTES`,
  or a share of a `MULTIDECODE_MEMORY` budget), and a batch-invariant forward gives the same
  logits cut or not. A request counts the scratch of its widest forward: its prompt's, cut.

`available_bytes` is what the machine can still give: the kernel's MemAvailable (capped by a
cgroup's limit where one is set, as in containers), free memory on a CUDA device, or the
`MULTIDECODE_MEMORY` environment variable ("6GB", "512MiB", bytes) where the user sets a budget:
what work may take besides the loaded weights, which are in memory already when it is asked.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import InvalidArgument, NotEnoughMemory
from .models.packed import activation_dtype

FORWARD_BYTES = 1 << 30
"""Scratch one forward may use (masks, scores, activations); wider forwards are cut."""
SCRATCH_SHARE = 0.25
"""The share of a `MULTIDECODE_MEMORY` budget one forward's scratch may take (the rest holds the
cache and the logits): under a budget of 100 MB a long prompt is read in pieces of 21 MB."""
BRANCH_BYTES = 16 << 10
"""Bookkeeping per branch: its sampler and generator, output, context and Python objects."""
SLOT_OVERHEAD = 160
"""Python bookkeeping per node beside its cache slot (the forest's lists and maps)."""
LOGITS_COPIES = 3
"""A step's logits are held up to three times: as the forwards return them, gathered, and as the
rows the branches choose from."""
HEADROOM = 0.85
"""The share of the available memory a request may plan to use; the rest absorbs what the
estimate does not see (allocator slack, other threads)."""
ENVIRONMENT = "MULTIDECODE_MEMORY"

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def _per_layer(config, name: str) -> list:
    """`name` of each layer of `config` (None where it does not say). A model whose layers differ
    (Gemma 4: a full attention layer's heads are wider than a sliding one's) describes each in
    `per_layer_config`, and its config refuses to give one global value (transformers raises
    `AmbiguousGlobalPerLayerAttributeError`, a RuntimeError, which getattr's default does not catch);
    others give the value itself as a list, one per layer (Gemma 3n's `intermediate_size`)."""
    layers = getattr(config, "per_layer_config", None)
    if layers:
        values = [getattr(layer, name, None) for layer in layers]
    else:
        try:
            value = getattr(config, name, None)
        except RuntimeError:
            value = None
        values = [value] * max(1, getattr(config, "num_hidden_layers", 0) or 0)
    # A value given as a list is one per layer (Gemma 3n's `intermediate_size`), whichever view gave it.
    return [v[i] if isinstance(v, (list, tuple)) else v for i, v in enumerate(values)]


def _kv_shapes(config) -> list[tuple[int, int]]:
    """(key-value heads, head size) of each layer."""
    hidden = getattr(config, "hidden_size", 0)
    heads = [h or 1 for h in _per_layer(config, "num_attention_heads")]
    if not getattr(config, "num_hidden_layers", 0) and not getattr(config, "per_layer_config", None):
        return []  # a config without layers (a test's fake) costs nothing
    return [(kv or h, dim or hidden // h) for h, kv, dim in
            zip(heads, _per_layer(config, "num_key_value_heads"), _per_layer(config, "head_dim"))]


@dataclass(frozen=True)
class Footprint:
    """What one model's forest costs, in bytes (see the module notes).

    kv_per_slot: one cache slot over all layers. logits_row: one float32 row of logits.
    per_row_slot, per_row, per_kept_row: a forward's scratch per (row, slot), per row, and per
    row whose logits it returns.
    """

    kv_per_slot: int
    logits_row: int
    per_row_slot: int
    per_row: int
    per_kept_row: int

    @classmethod
    def of(cls, model) -> Footprint:
        config = model.config.get_text_config()
        hidden = getattr(config, "hidden_size", 0)  # a config without these (a test's fake) costs nothing
        heads = max(h or 1 for h in _per_layer(config, "num_attention_heads"))  # the widest layer's
        dtype = activation_dtype(model)
        size = torch.finfo(dtype).bits // 8
        vocab = model.get_input_embeddings().num_embeddings
        intermediate = max(i or 4 * hidden for i in _per_layer(config, "intermediate_size"))
        return cls(
            kv_per_slot=sum(2 * kv_heads * head_dim for kv_heads, head_dim in _kv_shapes(config)) * size,
            logits_row=vocab * 4,
            # visibility (bool, and its kept copy), the mask, and scores and probabilities per head
            per_row_slot=2 + size + 2 * heads * max(size, 4),
            per_row=(3 * intermediate + 6 * hidden) * size,  # the widest activations of a layer
            per_kept_row=vocab * (size + 4),  # logits in the model's dtype and in float32
        )

    def rows_per_forward(self, slots: int, kept_share: float = 1.0) -> int:
        """The most rows (at least one) a forward over `slots` slots may take for its scratch to
        stay under `forward_bytes()`, when `kept_share` of its rows return logits."""
        row = slots * self.per_row_slot + self.per_row + kept_share * self.per_kept_row
        return max(1, int(forward_bytes() // row))

    def group_bytes(self, *, slots_before: int, prompt_slots: int, branches: int, branch_slots: int,
                    rows_per_branch: int = 1, cache_slots: int | None = None) -> Need:
        """What a group of `branches` branches will add: its prompt's `prompt_slots` slots once,
        `branch_slots` more for each branch (new tokens and draft room), over a forest that holds
        `slots_before` slots already; each branch asks for `rows_per_branch` logits rows a step.
        cache_slots: the cache slots to allocate for it (default: all its new slots; fewer where
        the cache has room already)."""
        slots = slots_before + prompt_slots + branches * branch_slots
        new_slots = prompt_slots + branches * branch_slots
        return Need(
            kv=(new_slots if cache_slots is None else cache_slots) * self.kv_per_slot + new_slots * SLOT_OVERHEAD,
            rows=branches * slots,
            logits=LOGITS_COPIES * branches * rows_per_branch * self.logits_row + branches * BRANCH_BYTES,
            scratch=self.scratch_bytes(slots, max(prompt_slots, branches * rows_per_branch)),
            slots=new_slots, scratch_row=self.scratch_row(slots),
            scratch_rows=max(1, prompt_slots, branches * rows_per_branch),
        )

    def scratch_row(self, slots: int) -> int:
        """The scratch of one row of a forward over `slots` slots that returns its logits."""
        return slots * self.per_row_slot + self.per_row + self.per_kept_row

    def scratch_bytes(self, slots: int, rows: int) -> int:
        """The scratch of the widest forward of a request: `rows` rows over `slots` slots (its
        prompt's, or a step's), cut to `forward_bytes()` (a piece holds one row at least)."""
        row = self.scratch_row(slots)
        return min(max(forward_bytes(), row), max(1, rows) * row)


def forward_bytes(setting: int | None = None) -> int:
    """The scratch one forward may use: `FORWARD_BYTES`, or `SCRATCH_SHARE` of a budget the user
    sets (`MULTIDECODE_MEMORY` caps the work's scratch too, not only its cache; `setting`: that
    variable's bytes, default what it says now)."""
    if setting is None and os.environ.get(ENVIRONMENT):
        setting = parse_bytes(os.environ[ENVIRONMENT])
    return FORWARD_BYTES if setting is None else min(FORWARD_BYTES, int(setting * HEADROOM * SCRATCH_SHARE))


@dataclass(frozen=True)
class Need:
    """A request's bytes by what holds them (see `Footprint.group_bytes`)."""

    kv: int
    rows: int
    logits: int
    scratch: int
    slots: int
    scratch_row: int  # the scratch of one row of the widest forward (a piece holds one at least)
    scratch_rows: int  # that forward's rows, read in pieces under `forward_bytes`

    @property
    def total(self) -> int:
        return self.kv + self.rows + self.logits + self.scratch

    def least_setting(self) -> int:
        """The least `MULTIDECODE_MEMORY` (bytes) under which this request fits: a budget is `HEADROOM`
        of it, and a forward's scratch grows with it (`forward_bytes`), so it is more than `total`."""
        rest = self.total - self.scratch

        def fits(setting: int) -> bool:
            scratch = min(max(forward_bytes(setting), self.scratch_row), self.scratch_rows * self.scratch_row)
            return rest + scratch <= int(setting * HEADROOM)

        return most_branches(lambda setting: not fits(setting), 1 << 50) + 1  # the first setting that fits

    def describe(self) -> str:
        return (f"{gigabytes(self.total)} ({gigabytes(self.kv)} of KV cache for {self.slots:,} tokens, "
                f"{gigabytes(self.rows)} of visibility rows, {gigabytes(self.logits + self.scratch)} of logits "
                "and forward scratch)")


def gigabytes(count: int) -> str:
    """A byte count in words: GB from 0.1 GB, MB from 0.1 MB, then kB and bytes (not "0.0 MB")."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= size / 10:
            return f"{count / size:.{2 if unit == 'GB' else 1}f} {unit}"
    return f"{count:,} bytes"


def setting_text(count: int) -> str:
    """A byte count as a `MULTIDECODE_MEMORY` value, rounded up so that it is not less ("7.1MB")."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= size:
            return f"{math.ceil(count / size * 10) / 10:g}{unit}"
    return str(count)


def parse_bytes(text: str) -> int:
    """'6GB', '512MiB', '1.5g' or a plain count of bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise InvalidArgument(f"{text!r} is not an amount of memory", "write it like 6GB, 512MiB or 1000000000")
    return round(float(match.group(1)) * _UNITS[unit])  # "7.1MB" is 7,100,000, not 7,099,999


def available_bytes(device: torch.device | str = "cpu") -> int:
    """Bytes the machine can still give on `device` (see the module notes)."""
    limit = os.environ.get(ENVIRONMENT)
    found = _cuda_free(torch.device(device)) if torch.device(device).type == "cuda" else _host_free()
    return min(found, parse_bytes(limit)) if limit else found


def budget_bytes(device: torch.device | str = "cpu") -> int:
    """What a request may plan to use: `HEADROOM` of what is available."""
    return int(available_bytes(device) * HEADROOM)


def check_budget(need: Need, budget: int, *, what: str, hint: str) -> None:
    """Refuse a request whose bytes exceed `budget`, naming both."""
    if need.total > budget:
        raise NotEnoughMemory(f"{what} needs about {need.describe()}, but {gigabytes(budget)} is available", hint)


def most_branches(fits, upper: int) -> int:
    """The largest w in 1..upper with fits(w) true (fits grows false with w), or 0."""
    low, high = 0, upper
    while low < high:
        middle = (low + high + 1) // 2
        if fits(middle):
            low = middle
        else:
            high = middle - 1
    return low


def _cuda_free(device: torch.device) -> int:
    free, _ = torch.cuda.mem_get_info(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return free + torch.cuda.memory_reserved(index) - torch.cuda.memory_allocated(index)


def _host_free() -> int:
    free = _meminfo_available()
    cgroup = _cgroup_room()
    return min(free, cgroup) if cgroup is not None else free


def _meminfo_available() -> int:
    available = proc_kilobytes("/proc/meminfo", "MemAvailable")
    if available is None:  # not Linux: free pages
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return available


def proc_kilobytes(path: str, key: str) -> int | None:
    """The bytes a /proc file's `key:` line gives in kB ("MemAvailable" of /proc/meminfo, "VmRSS"
    of /proc/self/status), None where the file or the line is not there."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def resident_bytes() -> int:
    """This process's resident memory (VmRSS), 0 where /proc is not there."""
    return proc_kilobytes("/proc/self/status", "VmRSS") or 0


def measure_bandwidth(*, repeats: int = 5, size: int = 512 << 20) -> float:
    """Bytes per second this machine reads, on torch's threads: the best of `repeats` sums over a
    float32 tensor of `size` bytes (the default far past any cache)."""
    import time

    values = torch.ones(size // 4, dtype=torch.float32)  # [size / 4]
    values.sum()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        values.sum()
        best = min(best, time.perf_counter() - start)
    return size / best


def _cgroup_room() -> int | None:
    """A cgroup's limit less its usage (v2, then v1), or None without a limit."""
    for limit, usage in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                         ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            top, used = Path(limit).read_text().strip(), Path(usage).read_text().strip()
        except OSError:
            continue
        if top.isdigit() and int(top) < 1 << 60:
            return max(0, int(top) - int(used))
    return None


__all__ = ["ENVIRONMENT", "FORWARD_BYTES", "Footprint", "Need", "NotEnoughMemory", "available_bytes", "budget_bytes",
           "check_budget", "forward_bytes", "measure_bandwidth", "most_branches", "parse_bytes", "resident_bytes"]
