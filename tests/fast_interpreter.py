"""Triton's interpreter (``TRITON_INTERPRET=1``) without its redundant re-patching.

A kernel launch patches ``triton.language`` for the interpreter once for its whole grid and
restores it after. Each call of a ``@triton.jit`` helper from inside the kernel (``wait_previous``,
a prologue, a slice of the program's work) patches it again, per program and per call, by walking
five namespaces with ``inspect.getmembers``; the patch it makes is discarded and changes nothing the
launch's has not. In the interpreted runner checks that walk was about a fifth of the time. Here a
helper's patch is skipped while the modules it would patch are patched already, and the numpy dtype
of a Triton type is looked up once per type; everything else runs as Triton runs it.
"""

from __future__ import annotations

import inspect
import os

import triton.language as tl


class _Unpatch:
    def __init__(self, scope: object, stack: list[frozenset[int]]) -> None:
        self.scope, self.stack = scope, stack

    def restore(self) -> None:
        self.stack.pop()
        self.scope.restore()


class _Nothing:
    def restore(self) -> None:
        pass


def install() -> None:
    """Under ``TRITON_INTERPRET=1`` (and a Triton whose interpreter patches per call), once."""
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return
    from triton.runtime import interpreter

    patch = getattr(interpreter, "_patch_lang", None)
    if patch is None or getattr(patch, "installed", False) or not hasattr(interpreter, "GridExecutor"):
        return  # another Triton: its interpreter as it is
    launches: list[frozenset[int]] = []  # the modules each running launch patched
    # The modules a helper's patch left patched: Triton never restores those (a library helper
    # such as ``tl.sum`` sees ``triton.language.core`` where the kernel sees ``triton.language``),
    # and its later patches of them find nothing left to patch.
    by_helpers: set[int] = set()

    def patch_lang(fn):  # noqa: ANN001, ANN202
        langs = frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))
        caller = inspect.currentframe().f_back
        if caller is not None and caller.f_code.co_name == "__call__" and "self" in caller.f_locals \
                and isinstance(caller.f_locals["self"], interpreter.GridExecutor):
            launches.append(langs)  # a launch: patched for its whole grid, restored after
            return _Unpatch(patch(fn), launches)
        if launches and langs <= launches[-1] | by_helpers:
            return _Nothing()  # a helper inside a launch whose modules are patched already
        scope = patch(fn)
        by_helpers.update(langs)
        return scope

    patch_lang.installed = True  # type: ignore[attr-defined]
    interpreter._patch_lang = patch_lang

    # Its numpy dtype of a Triton type builds a table of twenty dtypes per call, a few times an
    # operation: a pure function, remembered per type.
    np_dtype = getattr(interpreter, "_get_np_dtype", None)
    if np_dtype is not None:
        known: dict = {}

        def get_np_dtype(tt_dtype):  # noqa: ANN001, ANN202
            try:
                return known[tt_dtype]
            except KeyError:
                known[tt_dtype] = found = np_dtype(tt_dtype)
                return found
            except TypeError:  # not hashable
                return np_dtype(tt_dtype)

        interpreter._get_np_dtype = get_np_dtype
