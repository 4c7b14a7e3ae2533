"""SASS of a compiled rosekernels kernel, for the tests that inspect its instructions."""
import struct
import subprocess

from sip import SipError, sass


def sass_of(kernel, tmp_path) -> str | None:
    """nvdisasm -c of the kernel's cubin (with the program headers that trail its sections in the
    object file; nvdisasm rejects the image without them); None when nvdisasm is not installed."""
    try:
        tool = sass.find_nvdisasm()
    except SipError:
        return None
    start = kernel.object_bytes.find(kernel.cubin)
    phoff, = struct.unpack_from("<Q", kernel.cubin, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", kernel.cubin, 0x36)
    path = tmp_path / "k.cubin"
    path.write_bytes(kernel.object_bytes[start:start + max(len(kernel.cubin), phoff + phentsize * phnum)])
    return subprocess.run([tool, "-c", str(path)], capture_output=True, text=True, check=True).stdout
