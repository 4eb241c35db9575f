"""Capture and restore the random number generators that training code may use.

The state is plain data for ``state["rng"]``: ``{"torch": uint8 tensor, "cuda": [tensors], "python": tuple,
"numpy": [name, keys tensor, pos, has_gauss, cached] | None}``. numpy is captured only when it is already
imported (the worker never imports it for this).
"""

from __future__ import annotations

import ctypes
import random
import sys
from collections.abc import Mapping
from typing import Any

import torch


def capture() -> dict[str, Any]:
    """The current state of the torch (CPU and CUDA), Python and numpy generators."""
    np_state = numpy_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": cuda_states(),
        "python": python_state(),
        "numpy": list(np_state) if np_state is not None else None,
    }


def cuda_states() -> list[torch.Tensor]:
    """Every CUDA device's generator state, as ``torch.cuda.get_rng_state_all()``; empty until CUDA is used
    (``is_initialized()`` is cheap, and there is no CUDA RNG state to keep before)."""
    if not torch.cuda.is_initialized():
        return []
    # What get_rng_state_all() returns, without its per-device context switch.
    return [g.get_state() for g in torch.cuda.default_generators]


#: Python's global generator when last captured: (its Mersenne Twister words and index, gauss_next,
#: ``random.getstate()``); None until the first capture. ``_PY_RAW`` is False where the C layout read below
#: is not the one checked against ``getstate()`` (another interpreter or version): capture every time.
_python_last: tuple[bytes, Any, Any] | None = None
_PY_RAW: bool | None = None
_PY_OFFSET = 16  # CPython: the RandomObject's int index and uint32 state[624] follow PyObject_HEAD
_PY_BYTES = 4 + 624 * 4


#: (the generator ``random.getstate()`` reads, a ctypes array over its C words: ``.raw`` copies them in C).
_py_words: tuple[Any, Any] | None = None


def _python_raw() -> bytes:
    return ctypes.string_at(id(random._inst) + _PY_OFFSET, _PY_BYTES)


def python_state() -> Any:
    """``random.getstate()``, the very same tuple as at the last capture while nothing drew from the
    generator (building it anew is 625 ints per step; an unchanged state is then also recognised by
    identity, see ``TrainState.snapshot``)."""
    global _python_last, _PY_RAW, _py_words
    if _PY_RAW is None:  # once: does the C state read here match what getstate() reports?
        state = random.getstate()
        raw = _python_raw() if sys.implementation.name == "cpython" else b""
        words = tuple(int.from_bytes(raw[i : i + 4], "little") for i in range(4, _PY_BYTES, 4))
        index = int.from_bytes(raw[:4], "little", signed=True) if raw else None
        _PY_RAW = bool(raw) and sys.byteorder == "little" and state[1] == (*words, index)
        if _PY_RAW:  # the module's functions are bound to this instance, which they keep alive
            inst = random._inst
            _py_words = (inst, (ctypes.c_char * _PY_BYTES).from_address(id(inst) + _PY_OFFSET))
    if _py_words is None:
        return random.getstate()
    inst, words = _py_words
    raw, gauss = words.raw, inst.gauss_next
    last = _python_last
    if last is not None and last[0] == raw and last[1] == gauss:
        return last[2]
    state = random.getstate()
    _python_last = (raw, gauss, state)
    return state


#: numpy's global generator when last captured: (bit generator, its MT19937 words and position, capture).
_numpy_last: tuple[Any, bytes, list[Any]] | None = None
#: (numpy, its global RandomState, that one's bit generator, a ctypes array over the generator's C state),
#: made once per generator.
_numpy_words: tuple[Any, Any, Any, Any] | None = None
_MT_BYTES = 624 * 4 + 4


def numpy_state() -> list[Any] | None:
    """numpy's global RNG state as ``np.random.get_state()`` gives it (its key words as an int64 tensor), or
    None while numpy is not imported. The very same list as at the last capture while nothing drew from the
    generator: callers must not change it.

    ``np.random.get_state()`` costs about 0.1 ms. When numpy's MT19937 words and position are the ones of
    the last capture (read from the generator's C state, 2.5 KB) and no cached Gaussian was pending then,
    nothing drew from it since (every draw moves the position or consumes the Gaussian), so the last capture
    is still exact.
    """
    global _numpy_last, _numpy_words
    words = _numpy_words
    if words is None:
        np = sys.modules.get("numpy")
        if np is None:
            return None
    else:
        np = words[0]
    try:
        # np.random's functions are bound to mtrand's _rand (kept here), which keeps its bit generator.
        rand = words[1] if words is not None else np.random.mtrand._rand
        bits = rand._bit_generator
        if words is None or words[2] is not bits:
            address = bits.ctypes.state_address
            words = _numpy_words = (np, rand, bits, (ctypes.c_char * _MT_BYTES).from_address(address))
        raw = words[3].raw
    except (AttributeError, TypeError):  # another numpy layout: capture every time
        bits, raw = None, b""
    last = _numpy_last
    if bits is not None and last is not None and last[0] is bits and last[1] == raw and last[2][3] == 0:
        return last[2]
    name, keys, pos, has_gauss, cached = np.random.get_state()
    out = [name, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(cached)]
    if bits is not None:
        _numpy_last = (bits, ctypes.string_at(bits.ctypes.state_address, _MT_BYTES), out)
    return out


def restore(state: Mapping[str, Any]) -> None:
    """Put the generators back into a :func:`capture`-d state (parts that are missing are left alone)."""
    # Restored tensors may be views into one checkpoint buffer; set_rng_state needs a tensor that owns its
    # storage (torch 2.13 crashes with SIGSEGV on a view with a storage offset), hence the clones.
    if state.get("torch") is not None:
        torch.set_rng_state(state["torch"].cpu().clone())
    cuda = state.get("cuda") or []
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([t.cpu().clone() for t in cuda])
    if state.get("python") is not None:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
    if state.get("numpy") is not None:
        import numpy as np

        global _numpy_last
        _numpy_last = None

        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))


def seed_all(seed: int) -> None:
    """Seed torch (CPU and CUDA), Python and, if imported, numpy with ``seed``."""
    torch.manual_seed(seed)
    random.seed(seed)
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed(seed % 2**32)
