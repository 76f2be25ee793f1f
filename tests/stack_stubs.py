"""Import a serving stack's wheel from a side folder on CPU, with the third-party modules it
imports but does not need for building and loading a drafter replaced by empty stand-ins
(issue 42; `vllm_stack.py`, `sglang_stack.py`).

A stand-in module answers any attribute with a stand-in class; a stand-in class answers any
attribute with another, can be subclassed (class keywords are dropped), subscripted
(`Generic[T]`), or'ed into a type union, and called: called on one function it returns that
function (a decorator), otherwise another stand-in. Nothing the drafter's code runs goes
through one: a test that reached one would fail on the value it got back.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import os
import sys
import types


class _Anything(type):
    def __new__(mcs, name, bases, namespace, **_):
        return super().__new__(mcs, name, bases, namespace)

    def __init__(cls, name, bases, namespace, **_):
        super().__init__(name, bases, namespace)

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything(name, (), {})

    def __call__(cls, *args, **kwargs):
        if len(args) == 1 and not kwargs and callable(args[0]):
            if not isinstance(args[0], _Anything):
                return args[0]
        return _Anything("instance", (), {})

    def __getitem__(cls, item):
        return cls

    def __or__(cls, other):
        return cls

    __ror__ = __or__

    def __iter__(cls):
        return iter(())


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything(name, (), {})


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, names):
        self.names = frozenset(names)

    def find_spec(self, fullname, path, target=None):
        if any(fullname == n or fullname.startswith(n + ".") for n in self.names):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


@contextlib.contextmanager
def side_folder(folder, package, stubbed, env=None):
    """`package` importable from `folder` with the modules `stubbed` (and their submodules)
    replaced and
    `env` set; afterwards every module of `package` and of the stand-ins is dropped, the
    environment restored and the patches in the yielded list (object, name, old value)
    undone, so the next test file in this worker sees the interpreter as it was."""
    finder, saved_env = _StubFinder(stubbed), dict(os.environ)
    before = set(sys.modules)
    patches: list[tuple[object, str, object]] = []
    os.environ.update(env or {})
    sys.meta_path.insert(0, finder)
    sys.path.insert(0, str(folder))
    try:
        yield patches
    finally:
        for obj, name, old in reversed(patches):
            setattr(obj, name, old)
        sys.meta_path.remove(finder)
        sys.path.remove(str(folder))
        roots = {n.split(".")[0] for n in (package, *stubbed)}
        for name in set(sys.modules) - before:
            module = sys.modules[name]
            where = str(getattr(module, "__file__", None) or "")
            if name.split(".")[0] in roots or where.startswith(str(folder)):
                del sys.modules[name]
        os.environ.clear()
        os.environ.update(saved_env)


def patch(patches, obj, name, value):
    """Set `obj.name = value`, recorded in `side_folder`'s list to be undone."""
    patches.append((obj, name, getattr(obj, name)))
    setattr(obj, name, value)
