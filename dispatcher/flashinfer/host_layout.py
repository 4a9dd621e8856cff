"""FlashInfer 0.7.4's workspace layout function, built from the release for this CPU.

``calculateWorkspaceLayout`` (``nvlink_one_sided_alltoall.cu``) is host C++: it only adds and
aligns. ``build()`` cuts that function and ``alignOffset`` out of the release's file, compiles
them with the release's own ``moeAlltoAllMeta.h`` (the index enum) and the ``static constexpr``
limits of ``moeAlltoAllKernels.h`` (read from the file, not retyped), and ``HostLayout.layout()``
runs it: every field of ``MoeA2AWorkspaceLayout``, or FlashInfer's own error text. Nothing is
written by hand but the few lines that stand in for TVM-FFI's check macro and the CUDA headers
the two functions do not use. Needs a C++17 compiler (``$CXX``, else ``g++``).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

from .fetch import KERNELS_H, LAYOUT_CU, META_H, ReleaseError, source_file

__all__ = ["HostLayout", "build", "cut_function", "COMPILE_TIMEOUT_S", "RUN_TIMEOUT_S"]

COMPILE_TIMEOUT_S = 120
RUN_TIMEOUT_S = 60

_STANDINS = r"""
#include <array>
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>
// tensorrt_llm/common/config.h
#define TRTLLM_NAMESPACE_BEGIN namespace tensorrt_llm {
#define TRTLLM_NAMESPACE_END }
// TVM_FFI_ICHECK(cond) << message: throw the message when cond is false
struct CheckFailed {
  std::ostringstream text;
  template <class T> CheckFailed& operator<<(T const& v) { text << v; return *this; }
  [[noreturn]] ~CheckFailed() noexcept(false) { throw std::runtime_error(text.str()); }
};
#define TVM_FFI_ICHECK(cond) if (cond) {} else CheckFailed()
"""

_MAIN = r"""
int main() {
  long long ep, cap, k, d, c, r, e, cft;
  while (std::cin >> ep >> cap >> k >> d >> c >> r >> e >> cft) {
    try {
      auto l = calculateWorkspaceLayout(ep, cap, k, d, c, r, e, cft != 0);
      for (size_t i = 0; i < l.size(); ++i) std::cout << (i ? " " : "") << l[i];
      std::cout << "\n";
    } catch (std::exception const& ex) {
      std::string m = ex.what();
      for (auto& ch : m) if (ch == '\n') ch = ' ';
      std::cout << "ERROR " << m << "\n";
    }
  }
  return 0;
}
"""


def cut_function(source: str, signature: str) -> str:
    """The text of the function whose definition starts with ``signature``, through its
    closing brace (braces counted; FlashInfer's bodies hold no brace in a string)."""
    start = source.find(signature)
    if start < 0:
        raise ReleaseError(f"no definition starting {signature!r} in the release's source")
    depth, i = 0, source.index("{", start)
    while True:
        ch = source[i]
        depth += ch == "{"
        depth -= ch == "}"
        i += 1
        if depth == 0:
            return source[start:i]


def _kernel_limits(header: str) -> str:
    """The header's ``static constexpr`` integer limits (kMaxRanks, kCftCounterStride, ...)."""
    lines = re.findall(r"^static constexpr (?:int|int64_t|size_t) k\w+ = [^;]*;", header, re.M)
    if not any("kMaxRanks" in ln for ln in lines):
        raise ReleaseError("moeAlltoAllKernels.h has no kMaxRanks: not the 0.7.4 layout")
    return "\n".join(lines)


@dataclass(frozen=True)
class HostLayout:
    """The compiled layout function of one release, and its field names (the enum's order)."""

    binary: Path
    fields: Tuple[str, ...]

    def layouts(self, calls: Sequence[Tuple[int, ...]]) -> List[object]:
        """For each ``(ep_size, max_num_tokens, top_k, dispatch_bytes, combine_input_bytes,
        combine_recv_bytes, eplb_stats_num_experts, can_use_cft)``: ``{field: value}`` or
        FlashInfer's error text."""
        text = "".join(" ".join(str(int(v)) for v in call) + "\n" for call in calls)
        done = subprocess.run([str(self.binary)], input=text, capture_output=True, text=True,
                              timeout=RUN_TIMEOUT_S, check=True)
        out: List[object] = []
        for line in done.stdout.splitlines():
            if line.startswith("ERROR "):
                out.append(line[6:])
            else:
                out.append(dict(zip(self.fields, map(int, line.split()))))
        if len(out) != len(calls):
            raise RuntimeError(f"the host layout answered {len(out)} of {len(calls)} calls")
        return out


def _fields(meta: str) -> Tuple[str, ...]:
    body = meta[meta.index("enum MoeA2AMetaInfoIndex"):]
    body = body[:body.index("};")]
    pairs = re.findall(r"^\s*(\w+)_INDEX\s*=\s*(\d+)\s*,", body, re.M)
    pairs = sorted(((int(n), name.lower()) for name, n in pairs))
    return tuple(name for _, name in pairs)


def build(version: str, out_dir: Path = None) -> HostLayout:
    """Compile release ``version``'s layout function (the one-sided kernels'
    ``calculateWorkspaceLayout``) for this CPU (bounded by a timeout)."""
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise ReleaseError("no C++ compiler (set CXX, or install g++) to build FlashInfer's "
                           "host layout function")
    cu = source_file(version, LAYOUT_CU).read_text()
    meta_h = source_file(version, META_H)
    kernels = source_file(version, KERNELS_H).read_text()
    out_dir = Path(out_dir or tempfile.mkdtemp(prefix="a2a-gate-layout-"))
    inc = out_dir / "include" / "tensorrt_llm"
    (inc / "common").mkdir(parents=True, exist_ok=True)
    (inc / "kernels/moe/communication").mkdir(parents=True, exist_ok=True)
    (inc / "thop/moe/communication").mkdir(parents=True, exist_ok=True)
    (inc / "common/config.h").write_text("#pragma once\n")
    (inc / "kernels/moe/communication/moeAlltoAllKernels.h").write_text(
        "#pragma once\nnamespace tensorrt_llm { namespace kernels { namespace moe_comm {\n"
        + _kernel_limits(kernels) + "\n}}}\n")
    shutil.copy(meta_h, inc / "thop/moe/communication/moeAlltoAllMeta.h")
    program = "\n".join([
        _STANDINS,
        '#include "tensorrt_llm/thop/moe/communication/moeAlltoAllMeta.h"',
        "namespace tl = tensorrt_llm::kernels::moe_comm;",
        "namespace meta = tensorrt_llm::torch_ext::moe_comm;",
        re.search(r"constexpr size_t kCachelineAlignment = \d+;", cu).group(0),
        cut_function(cu, "inline size_t alignOffset("),
        cut_function(cu, "meta::MoeA2AWorkspaceLayout calculateWorkspaceLayout("),
        _MAIN,
    ])
    (out_dir / "layout.cpp").write_text(program)
    binary = out_dir / "layout"
    done = subprocess.run([cxx, "-std=c++17", "-O1", "-I", str(out_dir / "include"),
                           str(out_dir / "layout.cpp"), "-o", str(binary)],
                          capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
    if done.returncode:
        raise ReleaseError(f"FlashInfer {version}'s layout function did not compile:\n"
                           f"{done.stderr[-2000:]}")
    return HostLayout(binary, _fields(meta_h.read_text()))


def model_fields(offsets) -> Dict[str, int]:
    """Our ``workspace_074.Offsets`` under FlashInfer's field names."""
    return {
        "flag_val_offset": offsets.flag_val,
        "local_token_counter_offset": offsets.local_token_counter,
        "send_counters_offset": offsets.send_counters,
        "recv_counters_offset": offsets.recv_counters,
        "dispatch_completion_flags_offset": offsets.dispatch_completion_flags,
        "topk_target_ranks_offset": offsets.topk_target_ranks,
        "topk_target_indices_offset": offsets.topk_target_indices,
        "eplb_gathered_stats_offset": offsets.eplb_gathered_stats,
        "dispatch_payload_offset": offsets.dispatch_payload,
        "dispatch_payload_size": offsets.dispatch_payload_size,
        "combine_completion_flags_offset": offsets.combine_completion_flags,
        "combine_input_offset": offsets.combine_input,
        "combine_input_size": offsets.combine_input_size,
        "workspace_size": offsets.workspace_size,
    }
