"""An XLA FFI handler written in Python: the C ABI of ``xla/ffi/api/c_api.h`` in ctypes.

XLA calls a typed FFI handler as ``XLA_FFI_Error* handler(XLA_FFI_CallFrame*)``. omnicupy has no
compiled extension, so the handler is a ctypes callback (which takes the GIL when XLA's thread
calls it), wrapped in a PyCapsule for ``jax.ffi.register_ffi_target(..., api_version=1)``. The
frame gives the buffers (arguments and results: XLA's memory, no copies), the attributes, and,
through the ``XLA_FFI_Api`` function table, XLA's stream (``XLA_FFI_Stream_Get``), its device
allocator (``XLA_FFI_DeviceMemory_Allocate`` / ``_Free``) and error objects.

- Registration: XLA first calls the handler with a metadata extension and no stage; the handler
  answers the API version it was written against (0.1: every struct used here exists since) and
  no traits (so XLA never records it into a command buffer: the handler's host work must run at
  every execution, and its launches' pointers change between them).
- Execution: only the EXECUTE stage does work (INSTANTIATE / PREPARE / INITIALIZE return at once).
- Errors: any Python exception becomes an ``XLA_FFI_Error`` with its message (XLA raises it in
  the caller as an XlaRuntimeError).

Only the struct fields this module reads are trusted; the layouts follow c_api.h of XLA FFI API 0.x
(checked against jaxlib 0.10's copy; append-only within a major version).

Knows the FFI C ABI; nothing of attention (the caller gives ``execute(frame)``).
"""
from __future__ import annotations

import ctypes
from ctypes import POINTER, Structure, c_char_p, c_int, c_int32, c_int64, c_size_t, c_uint32, c_void_p
from typing import Any, Callable, Optional

#: XLA_FFI_Extension_Type, XLA_FFI_ExecutionStage, XLA_FFI_AttrType, XLA_FFI_Error_Code values used here.
EXTENSION_METADATA = 1
STAGE_EXECUTE = 3
ATTR_SCALAR, ATTR_STRING = 3, 4
ERROR_INTERNAL = 13
#: The FFI API version this handler is written against (XLA accepts older minors of its major).
API_MAJOR, API_MINOR = 0, 1
#: The largest alignment ``XLA_FFI_DeviceMemory_Allocate`` accepts (a power of two up to it;
#: anything larger fails with "Unsupported alignment", as 256 did with jaxlib 0.11's CUDA plugin).
MAX_ALIGNMENT = 16
#: XLA_FFI_DataType -> the ctypes type of a scalar attribute omnicupy reads (S32, S64, F32, F64).
SCALARS: dict[int, Any] = {4: c_int32, 5: c_int64, 11: ctypes.c_float, 12: ctypes.c_double}
#: XLA_FFI_DataType -> NumPy dtype name.
DTYPES = {1: "bool", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 6: "uint8", 7: "uint16", 8: "uint32",
          9: "uint64", 10: "float16", 11: "float32", 12: "float64", 16: "bfloat16"}


class ExtensionBase(Structure):
    pass


ExtensionBase._fields_ = [("struct_size", c_size_t), ("type", c_int), ("next", POINTER(ExtensionBase))]


class ApiVersion(Structure):
    _fields_ = [("struct_size", c_size_t), ("extension_start", POINTER(ExtensionBase)),
                ("major_version", c_int), ("minor_version", c_int)]


class Metadata(Structure):
    _fields_ = [("struct_size", c_size_t), ("api_version", ApiVersion), ("traits", c_uint32),
                ("state_type_id", c_int64)]


class MetadataExtension(Structure):
    _fields_ = [("extension_base", ExtensionBase), ("metadata", POINTER(Metadata))]


class Buffer(Structure):
    _fields_ = [("struct_size", c_size_t), ("extension_start", POINTER(ExtensionBase)), ("dtype", c_int),
                ("data", c_void_p), ("rank", c_int64), ("dims", POINTER(c_int64))]


class ByteSpan(Structure):
    _fields_ = [("ptr", c_void_p), ("len", c_size_t)]


class Scalar(Structure):
    _fields_ = [("dtype", c_int), ("value", c_void_p)]


class _List(Structure):
    """XLA_FFI_Args and XLA_FFI_Rets: size, types, pointers."""

    _fields_ = [("struct_size", c_size_t), ("extension_start", POINTER(ExtensionBase)), ("size", c_int64),
                ("types", POINTER(c_int)), ("items", POINTER(c_void_p))]


class Attrs(Structure):
    _fields_ = [("struct_size", c_size_t), ("extension_start", POINTER(ExtensionBase)), ("size", c_int64),
                ("types", POINTER(c_int)), ("names", POINTER(POINTER(ByteSpan))), ("attrs", POINTER(c_void_p))]


class ErrorCreateArgs(Structure):
    _fields_ = [("struct_size", c_size_t), ("extension_start", POINTER(ExtensionBase)), ("message", c_char_p),
                ("errc", c_int)]


class ErrorGetMessageArgs(Structure):
    _fields_ = [("struct_size", c_size_t), ("extension_start", POINTER(ExtensionBase)), ("error", c_void_p),
                ("message", c_char_p)]


class ErrorDestroyArgs(Structure):
    _fields_ = [("struct_size", c_size_t), ("extension_start", POINTER(ExtensionBase)), ("error", c_void_p)]


class StreamGetArgs(Structure):
    _fields_ = [("struct_size", c_size_t), ("extension_start", POINTER(ExtensionBase)), ("ctx", c_void_p),
                ("stream", c_void_p)]


class AllocateArgs(Structure):
    _fields_ = [("struct_size", c_size_t), ("extension_start", POINTER(ExtensionBase)), ("ctx", c_void_p),
                ("size", c_size_t), ("alignment", c_size_t), ("data", c_void_p)]


class FreeArgs(Structure):
    _fields_ = [("struct_size", c_size_t), ("extension_start", POINTER(ExtensionBase)), ("ctx", c_void_p),
                ("size", c_size_t), ("data", c_void_p)]


class DeviceOrdinalArgs(Structure):
    _fields_ = [("struct_size", c_size_t), ("extension_start", POINTER(ExtensionBase)), ("ctx", c_void_p),
                ("device_ordinal", c_int32)]


_ERROR_CREATE = ctypes.CFUNCTYPE(c_void_p, POINTER(ErrorCreateArgs))
_ERROR_MESSAGE = ctypes.CFUNCTYPE(None, POINTER(ErrorGetMessageArgs))
_ERROR_DESTROY = ctypes.CFUNCTYPE(None, POINTER(ErrorDestroyArgs))
_STREAM_GET = ctypes.CFUNCTYPE(c_void_p, POINTER(StreamGetArgs))
_ALLOCATE = ctypes.CFUNCTYPE(c_void_p, POINTER(AllocateArgs))
_FREE = ctypes.CFUNCTYPE(c_void_p, POINTER(FreeArgs))
_DEVICE_ORDINAL = ctypes.CFUNCTYPE(c_void_p, POINTER(DeviceOrdinalArgs))


class Api(Structure):
    """XLA_FFI_Api: the function table, in c_api.h's order (unused entries as plain pointers)."""

    _fields_ = [("struct_size", c_size_t), ("extension_start", POINTER(ExtensionBase)), ("api_version", ApiVersion),
                ("internal_api", c_void_p), ("Error_Create", _ERROR_CREATE), ("Error_GetMessage", _ERROR_MESSAGE),
                ("Error_Destroy", _ERROR_DESTROY), ("Handler_Register", c_void_p), ("Stream_Get", _STREAM_GET),
                ("Type_Register", c_void_p), ("ExecutionContext_Get", c_void_p), ("State_Set", c_void_p),
                ("State_Get", c_void_p), ("DeviceMemory_Allocate", _ALLOCATE), ("DeviceMemory_Free", _FREE),
                ("ThreadPool_Schedule", c_void_p), ("ThreadPool_NumThreads", c_void_p), ("Future_Create", c_void_p),
                ("Future_SetAvailable", c_void_p), ("Future_SetError", c_void_p), ("RunId_Get", c_void_p),
                ("DeviceOrdinal_Get", _DEVICE_ORDINAL)]


class CallFrame(Structure):
    _fields_ = [("struct_size", c_size_t), ("extension_start", POINTER(ExtensionBase)), ("api", POINTER(Api)),
                ("ctx", c_void_p), ("stage", c_int), ("args", _List), ("rets", _List), ("attrs", Attrs),
                ("future", c_void_p)]


HANDLER = ctypes.CFUNCTYPE(c_void_p, POINTER(CallFrame))


class FfiError(RuntimeError):
    """XLA's API returned an error from one of its calls."""


class BufferView:
    """One argument or result buffer: device address, NumPy dtype name, dims (row-major, dense)."""

    __slots__ = ("ptr", "dtype", "shape")

    def __init__(self, raw: Buffer) -> None:
        self.ptr = int(raw.data or 0)
        self.dtype = DTYPES.get(int(raw.dtype), f"xla-type-{int(raw.dtype)}")
        self.shape = tuple(int(raw.dims[i]) for i in range(int(raw.rank)))

    def __repr__(self) -> str:
        return f"BufferView({self.dtype}{list(self.shape)} at {self.ptr:#x})"


class Frame:
    """What ``execute`` sees of one call: ``args``/``rets`` (BufferViews), ``attrs`` (name -> int,
    float or str), and XLA's stream, device and allocator through ``stream()``, ``device()``,
    ``allocate()`` and ``free()``."""

    def __init__(self, raw: CallFrame) -> None:
        self._raw = raw
        self._api = raw.api.contents
        self.args = [BufferView(ctypes.cast(raw.args.items[i], POINTER(Buffer)).contents)
                     for i in range(int(raw.args.size))]
        self.rets = [BufferView(ctypes.cast(raw.rets.items[i], POINTER(Buffer)).contents)
                     for i in range(int(raw.rets.size))]
        self.attrs = _attributes(raw.attrs)

    def _check(self, err: Optional[int], what: str) -> None:
        """Raises FfiError with XLA's message if ``err`` (an XLA_FFI_Error*) is set, freeing it."""
        if not err:
            return
        args = ErrorGetMessageArgs(ctypes.sizeof(ErrorGetMessageArgs), None, err, None)
        self._api.Error_GetMessage(ctypes.byref(args))
        message = (args.message or b"").decode("utf-8", "replace")
        self._api.Error_Destroy(ctypes.byref(ErrorDestroyArgs(ctypes.sizeof(ErrorDestroyArgs), None, err)))
        raise FfiError(f"XLA FFI {what} failed: {message}")

    def stream(self) -> int:
        args = StreamGetArgs(ctypes.sizeof(StreamGetArgs), None, self._raw.ctx, None)
        self._check(self._api.Stream_Get(ctypes.byref(args)), "Stream_Get")
        return int(args.stream or 0)

    def device(self) -> Optional[int]:
        """XLA's device ordinal, or None when this XLA's API table has no DeviceOrdinal_Get."""
        if self._api.struct_size < Api.DeviceOrdinal_Get.offset + ctypes.sizeof(c_void_p):
            return None
        args = DeviceOrdinalArgs(ctypes.sizeof(DeviceOrdinalArgs), None, self._raw.ctx, 0)
        self._check(self._api.DeviceOrdinal_Get(ctypes.byref(args)), "DeviceOrdinal_Get")
        return int(args.device_ordinal)

    def allocate(self, size: int, alignment: int = MAX_ALIGNMENT) -> int:
        """``size`` bytes of XLA's device memory, aligned to ``alignment`` (at most MAX_ALIGNMENT)."""
        args = AllocateArgs(ctypes.sizeof(AllocateArgs), None, self._raw.ctx, size, alignment, None)
        self._check(self._api.DeviceMemory_Allocate(ctypes.byref(args)), f"DeviceMemory_Allocate({size} bytes)")
        return int(args.data)

    def free(self, ptr: int, size: int) -> None:
        args = FreeArgs(ctypes.sizeof(FreeArgs), None, self._raw.ctx, size, ptr)
        self._check(self._api.DeviceMemory_Free(ctypes.byref(args)), "DeviceMemory_Free")


def _attributes(raw: Attrs) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for i in range(int(raw.size)):
        span = raw.names[i].contents
        name = ctypes.string_at(span.ptr, span.len).decode()
        kind, item = int(raw.types[i]), raw.attrs[i]
        if kind == ATTR_SCALAR:
            scalar = ctypes.cast(item, POINTER(Scalar)).contents
            ctype: Any = SCALARS.get(int(scalar.dtype))
            if ctype is None:
                raise FfiError(f"attribute {name!r}: scalar type {int(scalar.dtype)} is not read by omnicupy")
            out[name] = ctypes.cast(scalar.value, POINTER(ctype)).contents.value
        elif kind == ATTR_STRING:
            span = ctypes.cast(item, POINTER(ByteSpan)).contents
            out[name] = ctypes.string_at(span.ptr, span.len).decode()
        else:
            raise FfiError(f"attribute {name!r}: kind {kind} is not read by omnicupy")
    return out


def _error(api: Api, message: str) -> int:
    text = message.encode("utf-8", "replace")
    args = ErrorCreateArgs(ctypes.sizeof(ErrorCreateArgs), None, text, ERROR_INTERNAL)
    return api.Error_Create(ctypes.byref(args)) or 0  # XLA copies the message


def _answer_metadata(ext: Any) -> None:
    meta = ctypes.cast(ext, POINTER(MetadataExtension)).contents.metadata.contents
    meta.api_version = ApiVersion(ctypes.sizeof(ApiVersion), None, API_MAJOR, API_MINOR)
    meta.traits = 0  # not command-buffer compatible: see the module docstring


def make_handler(execute: Callable[[Frame], None]):
    """(ctypes callback, PyCapsule) of a handler that calls ``execute(frame)`` at the EXECUTE
    stage. Keep the callback alive as long as XLA may call it (for the process, in practice)."""

    def handler(frame_ptr):
        raw = frame_ptr.contents
        ext = raw.extension_start
        if ext and ext.contents.type == EXTENSION_METADATA:
            _answer_metadata(ext)
            return None
        if raw.stage != STAGE_EXECUTE:
            return None
        try:
            execute(Frame(raw))
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to XLA as its error
            return _error(raw.api.contents, f"omnicupy: {type(exc).__name__}: {exc}")
        return None

    callback = HANDLER(handler)
    return callback, capsule(int(ctypes.cast(callback, c_void_p).value or 0))


def capsule(address: int):
    """A PyCapsule holding a function address (what jax.ffi.register_ffi_target takes)."""
    make = ctypes.pythonapi.PyCapsule_New
    make.restype = ctypes.py_object
    make.argtypes = (c_void_p, c_char_p, c_void_p)
    return make(address, None, None)


__all__ = ["BufferView", "Frame", "FfiError", "make_handler"]
