"""Build xlaopt's wheel, install it (not editable) into a fresh virtual environment, and check it.

Stages, each timed; the first failure stops the run with a message naming what failed:
  build    `pip wheel --no-deps` of a clean copy of the tree (tracked and untracked, not ignored,
           files: a stale build/ of an earlier layout cannot leak into the wheel)
  files    every file under a package-dir root of pyproject.toml (xlaopt/, models/, passes/) is in
           the wheel at its installed path (so every package's __init__.py, and any data file the
           code reads); nothing but xlaopt/ and its .dist-info at the top (no models, passes, tests)
  install  the wheel with its runtime dependencies (no extras) into a new venv
  import   every module of the installed package imports, from site-packages; a module that needs
           an optional extra (torch, orbax, grain, the CUDA plugin) may miss exactly that
  help     `xlaopt --help` and every subcommand's and sub-subcommand's --help (walked from
           xlaopt.cli.build_parser(), so new ones are covered) exit 0

Usage: bash .ci/wheel_check [--keep]   (--keep: leave the work directory for a look; the wrapper
runs this file with python3, or $PYTHON)
"""
from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
import zipfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Third-party modules that only optional extras bring (bench, parity, gpu-aot): a module of the
# wheel may fail to import for want of one of these, and only these, in the extras-free venv.
OPTIONAL = ("orbax", "grain", "torch", "diffusers", "accelerate", "transformers", "safetensors",
            "jax_cuda12_plugin", "jax_plugins")


class Failed(Exception):
    pass


def run(cmd: list[str], what: str, **kw) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if done.returncode != 0:
        shown = " ".join("<script>" if "\n" in str(c) else str(c) for c in cmd)  # not a -c script's text
        raise Failed(f"{what}: `{shown}` exited {done.returncode}\n"
                     f"--- stdout (tail)\n{done.stdout[-3000:]}\n--- stderr (tail)\n{done.stderr[-6000:]}")
    return done


def source_files() -> list[str]:
    """The tree's files as a clean clone would have them (plus untracked files not ignored)."""
    done = run(["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
               "git ls-files")
    return sorted(p for p in done.stdout.split("\0") if p and (ROOT / p).is_file())


def stage_build(work: pathlib.Path, files: list[str]) -> pathlib.Path:
    src = work / "src"
    for rel in files:
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, src / rel)
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(work / "dist"), str(src)],
        "building the wheel (pip wheel --no-deps)")
    wheels = list((work / "dist").glob("xlaopt-*.whl"))
    if len(wheels) != 1:
        raise Failed(f"expected one xlaopt wheel in {work / 'dist'}, found {[w.name for w in wheels]}")
    return wheels[0]


def stage_files(wheel: pathlib.Path, files: list[str]) -> str:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    package_dir = config["tool"]["setuptools"]["package-dir"]  # {"xlaopt.models": "models", ...}
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {}  # installed path -> source path
    for package, directory in package_dir.items():
        prefix = directory.rstrip("/") + "/"
        for rel in files:
            if rel.startswith(prefix):
                expected[package.replace(".", "/") + "/" + rel[len(prefix):]] = rel
    missing = sorted(dst for dst in expected if dst not in names)
    problems = []
    packages = sorted(d.rsplit("/", 1)[0] for d in missing if d.endswith("/__init__.py"))
    if packages:
        lines = []
        for d in packages:
            source = pathlib.Path(expected[d + "/__init__.py"]).parent
            count = sum(m.startswith(d + "/") for m in missing)
            lines.append(f"{d.replace('/', '.')}  (from {source}/, {count} files)")
        problems.append("packages missing from the wheel (setuptools did not find them; check "
                        "[tool.setuptools] in pyproject.toml):\n  " + "\n  ".join(lines))
    rest = [d for d in missing if not any(d.startswith(p + "/") for p in packages)]
    modules = [d for d in rest if d.endswith(".py")]
    if modules:
        problems.append("modules missing from the wheel:\n  "
                        + "\n  ".join(f"{d}  (from {expected[d]})" for d in modules))
    data = [d for d in rest if not d.endswith(".py")]
    if data:
        problems.append("files missing from the wheel (a data file the code reads needs "
                        "[tool.setuptools.package-data]; anything else belongs outside the package):\n  "
                        + "\n  ".join(f"{d}  (from {expected[d]})" for d in data))
    tops = sorted({n.split("/", 1)[0] for n in names})
    stray = [t for t in tops if t != "xlaopt" and not (t.startswith("xlaopt-") and t.endswith(".dist-info"))]
    if stray:
        problems.append(f"top-level entries other than xlaopt/ and its .dist-info: {stray} "
                        "(they would land in site-packages as packages of their own)")
    if problems:
        raise Failed(f"{wheel.name}: " + "\n".join(problems))
    inits_found = sum(n.endswith("/__init__.py") for n in names)
    return f"{len(names)} entries, {inits_found} packages, all {len(expected)} source files present"


def stage_install(work: pathlib.Path, wheel: pathlib.Path) -> pathlib.Path:
    venv = work / "venv"
    run([sys.executable, "-m", "venv", str(venv)], "creating the venv")
    python = venv / "bin" / "python"
    run([str(python), "-m", "pip", "install", "-q", str(wheel)], f"pip install {wheel.name}")
    return python


IMPORT_ALL = r"""
import importlib, pathlib, pkgutil, sys
import xlaopt
optional = set(sys.argv[1].split(","))
where = pathlib.Path(xlaopt.__file__).resolve()
if "site-packages" not in where.parts:
    sys.exit(f"xlaopt imported from {where}, not from the venv's site-packages")
bad, skipped, count = [], [], 0
for info in pkgutil.walk_packages(xlaopt.__path__, "xlaopt."):
    count += 1
    try:
        importlib.import_module(info.name)
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] in optional:
            skipped.append(f"{info.name} (needs {e.name})")
        else:
            bad.append(f"{info.name}: {type(e).__name__}: {e}")
    except Exception as e:
        bad.append(f"{info.name}: {type(e).__name__}: {e}")
if bad:
    sys.exit("modules that do not import from the wheel:\n  " + "\n  ".join(bad))
print(f"{count} modules import" + (f"; without an optional extra: {', '.join(skipped)}" if skipped else ""))
"""

HELP_ALL = r"""
import argparse, os, subprocess, sys
from xlaopt.cli import build_parser

def walk(parser, path):
    yield path
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from walk(sub, path + [name])

exe = os.path.join(os.path.dirname(sys.executable), "xlaopt")
bad, paths = [], list(walk(build_parser(), []))
for path in paths:
    done = subprocess.run([exe, *path, "--help"], capture_output=True, text=True, timeout=120)
    if done.returncode != 0 or not done.stdout.startswith("usage: xlaopt") or "Traceback" in done.stderr:
        bad.append(f"`xlaopt {' '.join(path + ['--help'])}` exited {done.returncode}:\n"
                   f"{done.stdout[-1000:]}{done.stderr[-2000:]}")
if bad:
    sys.exit("\n".join(bad))
print(f"{len(paths)} commands: " + ", ".join(" ".join(["xlaopt", *p]) for p in paths))
"""


def stage_import(python: pathlib.Path, work: pathlib.Path) -> str:
    # From the work directory, so the source tree is not on the path.
    return run([str(python), "-c", IMPORT_ALL, ",".join(OPTIONAL)], "importing every module of the wheel",
               cwd=work).stdout.strip()


def stage_help(python: pathlib.Path, work: pathlib.Path) -> str:
    return run([str(python), "-c", HELP_ALL], "the --help of every command", cwd=work).stdout.strip()


def main() -> int:
    keep = "--keep" in sys.argv[1:]
    if sys.version_info < (3, 11):
        print(f"wheel_check: needs Python >= 3.11 (xlaopt's requires-python); {sys.executable} is "
              f"{sys.version.split()[0]}", file=sys.stderr)
        return 2
    work = pathlib.Path(tempfile.mkdtemp(prefix="xlaopt-wheel-check-"))
    times, ok = [], False
    state: dict = {}
    stages = [
        ("build", lambda: state.update(wheel=stage_build(work, state["files"])) or state["wheel"].name),
        ("files", lambda: stage_files(state["wheel"], state["files"])),
        ("install", lambda: state.update(python=stage_install(work, state["wheel"])) or "no extras"),
        ("import", lambda: stage_import(state["python"], work)),
        ("help", lambda: stage_help(state["python"], work)),
    ]
    try:
        state["files"] = source_files()
        for name, stage in stages:
            t0 = time.perf_counter()
            try:
                detail = stage()
            except Failed as e:
                times.append((name, time.perf_counter() - t0, "FAILED"))
                print(f"wheel_check: stage '{name}' FAILED: {e}", file=sys.stderr)
                return 1
            times.append((name, time.perf_counter() - t0, "ok"))
            print(f"wheel_check: {name}: ok ({times[-1][1]:.1f} s): {detail}", flush=True)
        ok = True
        return 0
    finally:
        print("wheel_check stage times: " + ", ".join(f"{n} {s:.1f} s ({r})" for n, s, r in times))
        if keep or not ok:
            print(f"wheel_check: work directory kept: {work}", file=sys.stderr if not ok else sys.stdout)
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
