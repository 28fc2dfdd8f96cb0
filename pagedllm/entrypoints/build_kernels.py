"""``pagedllm build-kernels``: build the compiled CPU kernels ahead of time (a Docker image, CI,
the Makefile's set-up), or show what this machine runs (``--list``)."""
from __future__ import annotations

import argparse

from pagedllm import platform
from pagedllm.entrypoints.cli_args import SubParsers
from pagedllm.platform import build


def add_parser(sub: SubParsers) -> None:
    p = sub.add_parser("build-kernels", help="build the compiled CPU kernels now (they are cached)",
                       description="Builds the kernel library of this CPU's instruction-set level (or of "
                                   "PAGEDLLM_ISA's) into the cache ($PAGEDLLM_CACHE_DIR, default "
                                   "~/.cache/pagedllm), so that no engine start compiles.")
    p.add_argument("--all", action="store_true", help="every level up to this CPU's own (or PAGEDLLM_ISA's), "
                                                       "not only that one (the tests force each)")
    p.add_argument("--force", action="store_true", help="retry a level whose earlier build failed")
    p.add_argument("--list", action="store_true", help="show the CPU, its levels and what is cached; build nothing")
    p.set_defaults(func=run)


def _levels(all_levels: bool) -> list[str]:
    top = platform.isa_level()  # the CPU's own, or PAGEDLLM_ISA's
    wanted = platform.LEVELS[1:platform.LEVELS.index(top) + 1] if all_levels else [top]
    return sorted({lib for lib in map(build.library_level, wanted) if lib}, key=platform.LEVELS.index)


def _status(level: str) -> str:
    folder = build.build_dir(level)
    if (folder / build.LIBRARY_NAME).exists():
        return f"built: {folder / build.LIBRARY_NAME}"
    if (folder / "FAILED").exists():
        return f"failed: {(folder / 'FAILED').read_text().strip()} (log: {folder / 'build.log'})"
    return "not built yet"


def run(ns: argparse.Namespace) -> int:
    cpu = platform.cpu_info()
    print(f"CPU: {cpu.model_name}, {cpu.features()}; native level {cpu.native_level()}, "
          f"active level {platform.isa_level()}{' (PAGEDLLM_ISA)' if platform.is_forced() else ''}")
    levels = _levels(ns.all)
    if not levels:
        print("no compiled kernels at this level: torch's own ops serve (the portable path)")
        return 0
    if ns.list:
        for level in levels:
            print(f"  {level}: {_status(level)}")
        return 0
    return 1 if not all([_build(level, ns.force) for level in levels]) else 0


def _build(level: str, force: bool) -> bool:
    """Build (or find in the cache) one level's library, saying which; False if it failed."""
    result = build.build(level, force=force)
    if result.path is None:
        print(f"  {level}: FAILED: {result.error} (log: {result.log})")
        return False
    how = f"built in {result.seconds:.1f} s" if result.seconds else "cached"
    print(f"  {level}: {how}: {result.path}")
    return True
