"""numba intrinsics with which compiled code (progress.py's wait, engine/native.py's ops)
calls C functions by address and reads memory at an address; no Python runs in either.
And the key under which that code is cached on disk."""
import hashlib

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

__all__ = ['caller', 'typed_pointer', 'source_key']


def caller(ret_bits, arg_bits):
    """An intrinsic ``call(fn, (args...))``: the C function at address ``fn``, taking C
    integers (or pointers) of ``arg_bits`` bits and returning ``ret_bits`` (0: void),
    called with int64 arguments; -> int64 (0 for void). MPICH's handles are C ints
    passed in 64-bit registers, as ctypes passes them (mpiabi.CApi)."""
    @intrinsic
    def call(typingctx, fn, args):
        if not isinstance(args, types.BaseTuple) or len(args) != len(arg_bits):
            return None
        sig = types.int64(types.int64, args)

        def codegen(context, builder, signature, llargs):
            values = cgutils.unpack_tuple(builder, llargs[1], len(arg_bits))
            c_args = []
            for value, ty, bits in zip(values, signature.args[1], arg_bits):
                value = context.cast(builder, value, ty, types.int64)
                c_args.append(builder.trunc(value, ir.IntType(bits)) if bits < 64 else value)
            ret = ir.VoidType() if not ret_bits else ir.IntType(ret_bits)
            fnty = ir.FunctionType(ret, [ir.IntType(b) for b in arg_bits])
            result = builder.call(builder.inttoptr(llargs[0], fnty.as_pointer()), c_args)
            if not ret_bits:
                return ir.Constant(ir.IntType(64), 0)
            return builder.sext(result, ir.IntType(64)) if ret_bits < 64 else result
        return sig, codegen
    return call


def typed_pointer(dtype):
    """An intrinsic that turns an int64 address into a ``dtype`` pointer (for carray)."""
    @intrinsic
    def pointer(typingctx, address):
        sig = types.CPointer(dtype)(types.int64)

        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], context.get_value_type(signature.return_type))
        return sig, codegen
    return pointer


def source_key(paths):
    """A digest of the files at ``paths``: numba keys a cached function by its own file and
    bytecode only, so compiled code closes over this key of every file whose code or
    constants it compiles in, and a change in any of them compiles it again instead of
    loading stale machine code."""
    digest = hashlib.sha256()
    for path in paths:
        with open(path, 'rb') as fh:
            digest.update(fh.read())
    return digest.hexdigest()
