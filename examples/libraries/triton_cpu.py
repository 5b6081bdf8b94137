"""FLA's Triton kernels on a CPU, under Triton's interpreter: every adjustment
the adapters make to run them, in one place, applied to this process only
(no file of Triton or FLA is changed on disk). Import this module before
anything imports triton or fla; `enable()` applies the adjustments once.

What each adjustment changes, and why it does not change what a kernel
computes (docs/libraries.md, "FLA's Triton kernels on a CPU"):

1. TRITON_INTERPRET=1: `@triton.jit` functions become Triton's
   InterpretedFunction, which runs each program of the grid in turn with
   numpy on CPU tensors. Set before triton is first imported (the decorator
   reads it).
2. Autotuning without timing: Triton's Autotuner times every config with a
   GPU benchmarker. Here it keeps, of the configs FLA's own pruning leaves,
   the one with the largest blocks (the product of its block sizes; the last
   such in FLA's list): the fewest programs for the interpreter to run one by
   one (KDA's token-parallel kernel takes 8 heads a program, not 1: a
   140-token step in 8 s, not 21). Configs change block sizes and warps,
   never the result beyond rounding; on the interpreter warps and stages do
   nothing.
3. Loop counters are tensors: under the interpreter `tl.range` is Python's
   range, so a counter is a Python int, and FLA calls `i_t.to(tl.int64)` on
   one. The interpreter's range here yields int32 scalar tensors (what the
   compiler gives a counter), so `.to` exists and arithmetic is the same.
4. One kernel at a time in the process: the interpreter patches
   triton.language module-wide while a kernel runs and keeps the grid index
   in one global builder, so two rank threads running kernels at once would
   corrupt each other; and a kernel's first launch parses and rewrites its
   source, which CPython 3.11's AST constructor cannot do on two threads at
   once ("SystemError: AST constructor recursion depth mismatch"). Each launch,
   its rewrite included, holds a process lock (ranks still interleave between
   launches: collectives are called outside kernels).
5. Masks are booleans: a mask made of a Python bool and a tensor (FLA's
   `m_t = (t < seq_len) & m_d` with `seq_len` a Python int) comes out an
   integer tensor in the interpreter, which its load and store refuse ("mask
   has unsupported dtype"); the compiler makes it i1. Loads and stores take
   such a mask as bool (nonzero is true, as i1 is).
6. Builtins aliased by name are looked up when called: FLA binds
   `gather = tl.gather` at import (fla/ops/utils/op.py), so its kernels call
   the language's builtin itself, not the interpreter's stand-in for it, which
   exists only while a kernel runs ("Did you forget to add @triton.jit?").
   Every such alias in FLA's modules is replaced by a function that calls
   `triton.language.<name>` at the time of the call: the same builtin when
   compiled, the interpreter's while interpreted.
7. Every dot precision the compiler takes: FLA asks `input_precision=
   "bf16x3"` in the KDA backward's diagonal blocks (fp32 accuracy from three
   bf16 products on a GPU), which the interpreter's list of names lacks. Its
   dot ignores the precision and multiplies in the accumulator's dtype (fp32),
   as precise as bf16x3 or more: the names are added, nothing else changes.
8. FLA's CP device guard (`_check_cp_device`: "CP affine chains require
   NVIDIA Ampere or newer") is replaced by one that also accepts the CPU, in
   every module that imported it by name. The guard exists for the GPU's
   TF32x3 dot precision; the interpreter computes dots in fp32 (numpy).
9. bf16 arithmetic as the hardware does it: the interpreter keeps a bf16
   tensor as its bits (uint16), and its dot, its elementwise arithmetic, its
   reductions and scans then compute on those bits as integers (a 16 x 16
   bf16 dot off by 2.4e10), and it truncates fp32 to bf16. Here a bf16 dot
   widens its operands to fp32 (exactly) and multiplies and accumulates in
   the accumulator's dtype; elementwise bf16 arithmetic, reductions and scans
   are computed in fp32, each bf16 result rounded to nearest even (as a GPU's
   cvt.rn.bf16.f32), as is a cast from fp32 to bf16.
10. The language patched once a launch: the interpreter patches
   triton.language for a launch and restores it after, but also patches it
   again at every call of a `@triton.jit` helper inside the kernel (FLA's
   `exp2`, `safe_exp`, ...), walking every member of the language's modules
   each time (a quarter of an interpreted KDA step's time). A helper called
   while its launch's patches hold patches nothing more: the same stand-ins,
   found once.
"""
import os
import sys
import threading

if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("triton_cpu must be imported before triton (TRITON_INTERPRET is read when kernels are defined)")
os.environ["TRITON_INTERPRET"] = "1"

_LOCK = threading.RLock()
_enabled = []
LAUNCHES = [0]  # kernel launches run (a count for reports)


def _counter_range(arg1, arg2=None, step=None, **options):
    """range(...) whose counters are int32 scalar tensors, as compiled Triton's
    are (tl.range's compiler options, such as num_stages, do nothing here)."""
    import numpy as np
    import triton.language as tl
    from triton.runtime.interpreter import TensorHandle
    bounds = [int(a.handle.data.item()) if isinstance(a, tl.tensor) else int(getattr(a, "value", a))
              for a in (arg1, arg2, step) if a is not None]
    if arg2 is None and step is not None:
        bounds = [0] + bounds
    for i in range(*bounds):
        yield tl.tensor(TensorHandle(np.array(i, dtype=np.int32), tl.int32), tl.int32)


_SEEN = set()
_MODULES_SEEN = [0]  # len(sys.modules) at the last scan: a launch scans only after an import
_BUILTINS = {}  # id of a triton.language builtin -> (its namespace, its name)


def _forward_aliases():
    """6. every FLA module's alias of a triton.language builtin, forwarded to the
    builtin of that name at call time (modules imported since the last launch:
    nothing to do when none was)."""
    if len(sys.modules) == _MODULES_SEEN[0]:
        return
    _MODULES_SEEN[0] = len(sys.modules)
    import triton.language as tl
    if not _BUILTINS:
        for space in (tl, tl.math):
            for name in dir(space):
                value = getattr(space, name)
                if getattr(value, "__triton_builtin__", False):
                    _BUILTINS.setdefault(id(value), (space, name))
    for module_name in [name for name in list(sys.modules) if name.startswith("fla") and name not in _SEEN]:
        _SEEN.add(module_name)
        module = sys.modules[module_name]
        for attr, value in list(vars(module).items() if module is not None else []):
            if id(value) in _BUILTINS and not attr.startswith("__"):
                space, name = _BUILTINS[id(value)]
                setattr(module, attr, _forwarder(space, name))


def _forwarder(space, name):
    def call(*args, **kwargs):
        return getattr(space, name)(*args, **kwargs)
    call.__name__ = name
    return call


def enable():
    """Applies the adjustments (once). Returns the modules whose CP guard was replaced."""
    if _enabled:
        return _enabled[0]
    import triton.runtime.autotuner as autotuner
    import triton.runtime.interpreter as interpreter

    # 2. of the configs FLA's pruning keeps, the largest blocks, untimed
    import math
    prune = autotuner.Autotuner.prune_configs

    def largest_blocks(self, kwargs):
        configs = prune(self, kwargs)
        size = [math.prod(v for v in c.kwargs.values() if isinstance(v, int)) for c in configs]
        return [configs[max(range(len(configs)), key=lambda i: (size[i], i))]] if configs else configs
    autotuner.Autotuner.prune_configs = largest_blocks

    # 3. loop counters as int32 tensors: `for i in range(...)` and tl.range in a
    # kernel's source (the interpreter already rewrites each kernel's AST once)
    import ast
    interpreter._cpsim_counter_range = _counter_range  # copied into a kernel's globals when it is rewritten

    class CounterRanges(interpreter.ASTTransformer):
        def visit_For(self, node):
            node = self.generic_visit(node)
            call = node.iter
            if isinstance(call, ast.Call) and (
                    (isinstance(call.func, ast.Name) and call.func.id == "range") or
                    (isinstance(call.func, ast.Attribute) and call.func.attr == "range")):
                call.func = ast.Name(id="_cpsim_counter_range", ctx=ast.Load())
            return node
    interpreter.FunctionRewriter.ast_transformer = CounterRanges()

    # 4. one launch at a time, from the kernel's rewrite to its last program
    launch = interpreter.InterpretedFunction.run

    def serialised(self, *args, **kwargs):
        with _LOCK:
            _forward_aliases()
            LAUNCHES[0] += 1
            return launch(self, *args, **kwargs)
    interpreter.InterpretedFunction.run = serialised

    # 10. the language patched once a launch (a helper's call inside it finds it patched)
    _patch_once_a_launch(interpreter)

    # 5. integer masks taken as bool by loads and stores
    import numpy as np
    builder = interpreter.InterpreterBuilder
    masked_load, masked_store = builder.create_masked_load, builder.create_masked_store

    def as_bool(mask):
        if mask.data.dtype == np.bool_:
            return mask
        return interpreter.TensorHandle(mask.data.astype(np.bool_), interpreter.tl.int1)

    def load(self, ptrs, mask, other, cache_policy, is_volatile):
        return masked_load(self, ptrs, as_bool(mask), other, cache_policy, is_volatile)

    def store(self, ptrs, value, mask, cache_policy):
        return masked_store(self, ptrs, value, as_bool(mask), cache_policy)
    builder.create_masked_load, builder.create_masked_store = load, store

    # 7. the dot precisions the compiler takes
    import dataclasses
    options = interpreter.interpreter_builder.options
    interpreter.interpreter_builder.options = dataclasses.replace(
        options, allowed_dot_input_precisions=tuple(options.allowed_dot_input_precisions) + ("bf16x3", "bf16x6"))

    # 9. bf16 arithmetic as the hardware does it
    _bf16_as_hardware(interpreter, np)

    # 8. FLA's CP device guard, wherever it was imported by name
    import fla.ops.cp.context as context
    guard = context._check_cp_device

    def check_cp_device(device):
        if device.type != "cpu":
            guard(device)
    patched = []
    import fla.ops.cp  # noqa: F401 - imports the modules that hold the guard
    for name, module in list(sys.modules.items()):
        if name.startswith("fla.") and getattr(module, "_check_cp_device", None) is guard:
            module._check_cp_device = check_cp_device
            patched.append(name)
    _enabled.append(sorted(patched))
    return _enabled[0]


def _patch_once_a_launch(interpreter):
    """Adjustment 10 (the module's docstring)."""
    patch, tl, held = interpreter._patch_lang, interpreter.tl, []  # held: the launch's scope, while it runs

    def langs(fn):
        return {id(v) for v in fn.__globals__.values() if v is tl or v is tl.core}

    class Restoring:
        def __init__(self, scope, patched):
            self.scope, self.patched = scope, patched

        def restore(self):
            held.remove(self)
            self.scope.restore()

    class Held:
        def restore(self):
            pass

    def patch_lang(fn):
        mine = langs(fn)
        if held:  # a helper's call inside a launch: its scope is never restored (the interpreter's way)
            if not mine <= held[-1].patched:
                patch(fn)
                held[-1].patched |= mine
            return Held()
        scope = Restoring(patch(fn), mine)
        held.append(scope)
        return scope
    interpreter._patch_lang = patch_lang


def to_bf16_bits(x, np):
    """fp32 values as bf16 bits (uint16), rounded to nearest even (NaN kept NaN)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FC0), rounded)


def from_bf16_bits(bits, np):
    """bf16 bits (uint16) as the fp32 values they are (exact)."""
    return (np.ascontiguousarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def _bf16_as_hardware(interpreter, np):
    """Adjustment 9 (the module's docstring)."""
    tl, TensorHandle, builder = interpreter.tl, interpreter.TensorHandle, interpreter.InterpreterBuilder

    def is_bf16(handle):
        return handle.dtype.scalar == tl.bfloat16

    def widened(handle):
        return TensorHandle(from_bf16_bits(handle.data, np), tl.float32) if is_bf16(handle) else handle

    dot = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if not (is_bf16(a) or is_bf16(b) or is_bf16(d)):
            return dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        out = dot(self, widened(a), widened(b), widened(d), input_precision, max_num_imprecise_acc)
        return TensorHandle(to_bf16_bits(out.data, np), tl.bfloat16) if is_bf16(d) else out

    def in_fp32(op, *args):
        """op on the operands widened to fp32; a bf16 result rounded back."""
        out = op(*[widened(a) for a in args])  # a comparison's result is bool data: kept
        return TensorHandle(to_bf16_bits(out.data, np), tl.bfloat16) if out.data.dtype == np.float32 else out

    binary, unary, fma = builder.binary_op, builder.unary_op, builder.create_fma

    def binary_op(self, lhs, rhs, op):
        if is_bf16(lhs) or is_bf16(rhs):
            return in_fp32(lambda a, b: binary(self, a, b, op), lhs, rhs)
        return binary(self, lhs, rhs, op)

    def unary_op(self, arg, op):
        if is_bf16(arg):
            return in_fp32(lambda a: unary(self, a, op), arg)
        return unary(self, arg, op)

    def create_fma(self, x, y, z):
        if is_bf16(x) or is_bf16(y) or is_bf16(z):
            return in_fp32(lambda a, b, c: fma(self, a, b, c), x, y, z)
        return fma(self, x, y, z)

    cast = builder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return TensorHandle(to_bf16_bits(src.data, np), tl.bfloat16)
        return cast(self, src, dst_type)
    builder.create_dot, builder.binary_op, builder.unary_op = create_dot, binary_op, unary_op
    builder.create_fma, builder.cast_impl = create_fma, cast_impl

    # Reductions and scans (tl.sum, tl.max, tl.cumsum, ...) of bf16 values: in
    # fp32, each bf16 result rounded back.
    for ops in (interpreter.ReduceOps, interpreter.ScanOps):
        def apply_impl(self, input, _apply=ops.apply_impl):
            if not any(t.dtype.scalar == tl.bfloat16 for t in input):
                return _apply(self, input)
            wide = tuple(self.to_tensor(from_bf16_bits(t.handle.data, np), tl.float32)
                         if t.dtype.scalar == tl.bfloat16 else t for t in input)
            out = _apply(self, wide)
            many = isinstance(out, (list, tuple))
            was = [t.dtype.scalar == tl.bfloat16 for t in input]  # output i is input i's (an index: int32)
            out = [self.to_tensor(to_bf16_bits(o.handle.data, np), tl.bfloat16)
                   if i < len(was) and was[i] and o.handle.data.dtype == np.float32 else o
                   for i, o in enumerate(out if many else [out])]
            return out if many else out[0]
        ops.apply_impl = apply_impl
