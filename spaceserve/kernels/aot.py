"""Ahead-of-time sm_90 (Hopper) compile check for every kernel configuration, with no GPU.

The Triton interpreter accepts code the real compiler rejects (a `tl.dot` with K < 16), never
checks shared memory or registers, and hides API drift between Triton versions. This module
compiles each `CompileSpec` that a kernel module lists in `compile_specs()` for sm_90a through
Triton's own compiler and bundled ptxas, then checks what the H200 would refuse at load time:

- the compile itself (type errors, dot shape rules, API drift),
- dynamic shared memory <= 232448 bytes per block (the H200 opt-in limit),
- `wgmma` in the PTX where the spec expects tensor cores (`expect_wgmma`).

Registers and spill bytes are reported, not judged. The check needs real `@triton.jit`
functions, so it runs with TRITON_INTERPRET unset, in its own process::

    spaceserve compile-check [--json OUT] [--module NAME_OR_FILE ...] [--jobs N]
    python -m spaceserve.kernels.aot ...          (the same)

Pointer arguments get the 16-byte divisibility hint the JIT gives torch allocations; an integer
type written "i32:16" gets it too.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import json
import os
import pkgutil
import re
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from spaceserve.kernels.persistent import CompileSpec

SM90_MAX_SHARED = 232448
# Modules of spaceserve.kernels that hold infrastructure, not kernels.
INFRA_MODULES = frozenset({"aot", "budget", "configs", "persistent", "testing"})


@dataclass
class CompileResult:
    """Outcome of compiling one spec for sm_90a."""

    name: str
    ok: bool
    error: str | None = None
    shared_bytes: int | None = None
    has_wgmma: bool | None = None
    n_regs: int | None = None
    spills: int | None = None
    compile_s: float = 0.0
    module: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _is_jit_function(fn: Any) -> bool:
    from triton.runtime.jit import JITFunction

    return isinstance(fn, JITFunction)


def _short_error(exc: BaseException, limit: int = 400) -> str:
    """The informative tail of a compiler error (Triton puts the reason on the last lines)."""
    lines = [ln.rstrip() for ln in str(exc).strip().splitlines() if ln.strip(" ^~\t")]
    tail = " | ".join(lines[-2:]) if lines else ""
    text = f"{type(exc).__name__}: {tail}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def build_source_args(spec: CompileSpec) -> tuple[dict[str, str], dict[str, Any], dict]:
    """(signature, constexprs, attrs) for `ASTSource`, in the form Triton 3.6-3.9 expect.

    Every kernel argument appears in the signature, constexprs as the type "constexpr" with their
    values keyed by name; defaults of omitted constexpr parameters are filled in. Raises
    `ValueError` naming the argument when the spec does not cover the kernel's parameters.
    """
    fn = spec.kernel
    names = list(fn.arg_names)
    unknown = [k for k in list(spec.signature) + list(spec.constexprs) if k not in names]
    if unknown:
        raise ValueError(f"{spec.name}: {unknown} are not arguments of {fn.__name__}")
    both = set(spec.signature) & set(spec.constexprs)
    if both:
        raise ValueError(f"{spec.name}: {sorted(both)} given both a type and a constexpr value")
    signature: dict[str, str] = {}
    constexprs: dict[str, Any] = dict(spec.constexprs)
    attrs: dict[tuple[int], list] = {}
    for i, param in enumerate(fn.params):
        name = param.name
        if name in spec.constexprs:
            signature[name] = "constexpr"
            continue
        if name in spec.signature:
            ty, _, hint = spec.signature[name].partition(":")
            signature[name] = ty.strip()
            if ty.startswith("*") or hint.strip() == "16":
                attrs[(i,)] = [["tt.divisibility", 16]]
            continue
        if param.is_constexpr and param.default is not inspect.Parameter.empty:
            signature[name] = "constexpr"
            constexprs[name] = param.default
            continue
        kind = "constexpr value" if param.is_constexpr else "type in signature"
        raise ValueError(f"{spec.name}: argument {name!r} of {fn.__name__} has no {kind}")
    return signature, constexprs, attrs


def _ptxas_path() -> str | None:
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        return get_ptxas(90).path
    except Exception:
        return None


def _tool_path(tool: str) -> str | None:
    ptxas = _ptxas_path()
    if ptxas is None:
        return None
    cand = Path(ptxas).with_name(tool)
    return str(cand) if cand.exists() else None


def resource_usage(cubin: bytes, ptx: str | None) -> tuple[int | None, int | None]:
    """(registers per thread, spill-store bytes), read with the ptxas/cuobjdump Triton ships.

    Registers come from the compiled cubin; spills from re-running ptxas -v on the PTX (skipped,
    as it costs a second assembly, when `ptx` is None). Either is None when the tool is missing
    or its output cannot be parsed.
    """
    n_regs = spills = None
    with tempfile.TemporaryDirectory() as tmp:
        cub = Path(tmp, "k.cubin")
        cub.write_bytes(cubin)
        cuobjdump = _tool_path("cuobjdump")
        if cuobjdump:
            out = subprocess.run([cuobjdump, "--dump-resource-usage", str(cub)],
                                 capture_output=True, text=True).stdout
            m = re.search(r"REG:(\d+)", out)
            n_regs = int(m.group(1)) if m else None
        ptxas = _ptxas_path()
        if ptxas and ptx is not None:
            src = Path(tmp, "k.ptx")
            src.write_text(ptx)
            res = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", str(src), "-o",
                                  str(Path(tmp, "o.cubin"))], capture_output=True, text=True)
            m = re.search(r"(\d+) bytes spill stores", res.stdout + res.stderr)
            spills = int(m.group(1)) if m else None
    return n_regs, spills


def compile_sm90(spec: CompileSpec, spills: bool = True) -> CompileResult:
    """Compile `spec` for sm_90a ahead of time and check shared memory and wgmma use.

    `spills=False` skips re-running ptxas for the spill count (the slow part of a cached run).
    """
    t0 = time.perf_counter()
    res = CompileResult(name=spec.name, ok=False)
    if not _is_jit_function(spec.kernel):
        res.error = ("kernel is not a @triton.jit JITFunction (was it defined under "
                     "TRITON_INTERPRET=1? run `python -m spaceserve.kernels.aot` without it)")
        return res
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource

        signature, constexprs, attrs = build_source_args(spec)
        src = ASTSource(spec.kernel, signature, constexprs, attrs=attrs)
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": spec.num_warps,
                                           "num_stages": spec.num_stages})
    except Exception as exc:  # compile errors come in many types; report the message
        res.error = _short_error(exc)
        res.compile_s = time.perf_counter() - t0
        return res
    ptx = compiled.asm.get("ptx", "")
    res.shared_bytes = int(compiled.metadata.shared)
    res.has_wgmma = "wgmma" in ptx
    try:
        res.n_regs, res.spills = resource_usage(compiled.asm.get("cubin", b""),
                                                ptx if spills else None)
    except Exception:
        pass
    problems = []
    if res.shared_bytes > SM90_MAX_SHARED:
        problems.append(f"shared memory {res.shared_bytes} B > {SM90_MAX_SHARED} B (sm_90 limit)")
    if spec.expect_wgmma and not res.has_wgmma:
        problems.append("expected wgmma in the PTX, found none")
    res.ok = not problems
    res.error = "; ".join(problems) or None
    res.compile_s = time.perf_counter() - t0
    return res


def _import_target(target: str):
    """Import a dotted module name or a .py file path."""
    if target.endswith(".py"):
        path = Path(target).resolve()
        spec = importlib.util.spec_from_file_location(f"_aot_{path.stem}", path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load {target}")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
        return mod
    return importlib.import_module(target)


def kernel_module_names() -> list[str]:
    """Dotted names of the kernel modules present in spaceserve.kernels."""
    pkg = importlib.import_module("spaceserve.kernels")
    return sorted(m.name for m in pkgutil.walk_packages(pkg.__path__, "spaceserve.kernels.")
                  if not m.ispkg and m.name.rsplit(".", 1)[1] not in INFRA_MODULES
                  and not m.name.rsplit(".", 1)[1].startswith("_"))


def collect_specs(targets: list[str]) -> tuple[list[tuple[str, CompileSpec]], list[CompileResult],
                                                list[str]]:
    """(module, spec) pairs, failures to import or list, and modules without compile_specs()."""
    specs: list[tuple[str, CompileSpec]] = []
    failures: list[CompileResult] = []
    without: list[str] = []
    for target in targets:
        try:
            mod = _import_target(target)
            fn = getattr(mod, "compile_specs", None)
            if fn is None:
                without.append(target)
                continue
            listed = list(fn())
        except Exception as exc:
            failures.append(CompileResult(name=f"{target} (import/compile_specs)", ok=False,
                                          error=_short_error(exc), module=target))
            traceback.print_exc()
            continue
        specs.extend((target, s) for s in listed)
    return specs, failures, without


_WORK: list[tuple[str, CompileSpec]] = []
_SPILLS = [True]


def _compile_index(i: int) -> dict[str, Any]:
    module, spec = _WORK[i]
    res = compile_sm90(spec, spills=_SPILLS[0])
    res.module = module
    return res.to_dict()


def compile_all(specs: list[tuple[str, CompileSpec]], jobs: int = 1,
                spills: bool = True) -> list[CompileResult]:
    """Compile every spec, in `jobs` forked processes when jobs > 1."""
    _WORK[:] = specs
    _SPILLS[0] = spills
    if jobs <= 1 or len(specs) <= 1:
        rows = [_compile_index(i) for i in range(len(specs))]
    else:
        import multiprocessing as mp

        with mp.get_context("fork").Pool(min(jobs, len(specs))) as pool:
            rows = pool.map(_compile_index, range(len(specs)), chunksize=1)
    return [CompileResult(**r) for r in rows]


def format_table(results: list[CompileResult]) -> str:
    head = f"{'spec':44} {'ok':4} {'shared KB':>9} {'wgmma':>5} {'regs':>4} {'spill':>5} {'s':>5}"
    lines = [head, "-" * len(head)]
    for r in results:
        kb = f"{r.shared_bytes / 1024:.1f}" if r.shared_bytes is not None else "-"
        wg = {True: "yes", False: "no", None: "-"}[r.has_wgmma]
        regs = str(r.n_regs) if r.n_regs is not None else "-"
        spill = str(r.spills) if r.spills is not None else "-"
        lines.append(f"{r.name[:44]:44} {'ok' if r.ok else 'FAIL':4} {kb:>9} {wg:>5} {regs:>4} "
                     f"{spill:>5} {r.compile_s:5.1f}")
        if r.error:
            lines.append(f"    {r.error}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """`python -m spaceserve.kernels.aot` (= `spaceserve compile-check`)."""
    from spaceserve.cli_args import build_compile_check_parser

    return run(build_compile_check_parser("python -m spaceserve.kernels.aot").parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """The compile check for parsed arguments (see `build_compile_check_parser`)."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("TRITON_INTERPRET is set: unset it, the check needs the real compiler",
              file=sys.stderr)
        return 2
    warnings.filterwarnings("ignore", message=".*TRITON_DEFAULT_FP_FUSION.*")
    import triton

    targets = args.module or kernel_module_names()
    specs, failures, without = collect_specs(targets)
    results = failures + compile_all(specs, args.jobs, spills=not args.no_spills)
    print(f"triton {triton.__version__}, target sm_90a; modules: {len(targets)}, "
          f"specs: {len(specs)}")
    if without:
        print("modules without compile_specs(): " + ", ".join(without))
    if not specs and not failures:
        print("no compile specs found: nothing to check")
    print(format_table(results))
    n_bad = sum(not r.ok for r in results)
    print(f"sm_90 compile check: {len(results) - n_bad} ok, {n_bad} failing")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "triton": triton.__version__, "modules": targets, "without_specs": without,
            "results": [r.to_dict() for r in results]}, indent=1))
    return 1 if n_bad else 0


if __name__ == "__main__":
    sys.exit(main())
