"""What the trainer-only GPU check needs, checked in seconds before it trains (``scripts/gpu-smoke.sh
--trainer-only``): Python >= 3.11, torch (and a CUDA device when the check runs on one), transformers
>= 5 (the loader and the export write its checkpoint layout), an NVIDIA driver new enough for the CUDA
runtime torch was built for (R580+ for the CUDA 13 wheels; :mod:`staleflow.adapters.rlkit.cuda_driver`,
printed with it either way), setuptools (``megatron.core`` imports
it; a fresh Python 3.12 venv has none) and megatron-core for this Python when Megatron is checked.

Each problem is one line naming its cause and what to do; a megatron-core that is installed but does
not import is reported by the error it raises, not as a missing wheel. Standard library only (the
driver check is StaleFlow's, itself standard library only, imported once Python and torch passed),
and written so that an older Python can still run it far enough to say that it is too old.
Run as ``python gpu_smoke_preflight.py --backends fsdp,torch,megatron --device cuda --wheels DIR``:
exit 0 and one ``gpu-smoke preflight: ok ...`` line, or exit 2 and one line per problem.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

#: the oldest Python StaleFlow runs on (pyproject's requires-python)
MIN_PYTHON = (3, 11)
#: the transformers major version the loader and the export are written for
MIN_TRANSFORMERS_MAJOR = 5
MEGATRON_WHEEL = "megatron-core==0.16.1"


def _version() -> str:
    return f"{sys.version_info[0]}.{sys.version_info[1]}"


def python_tag() -> str:
    """This interpreter's wheel tag, ``cp311`` for CPython 3.11."""
    return f"cp{sys.version_info[0]}{sys.version_info[1]}"


def _import_error(module: str) -> Exception | None:
    """None if ``module`` imports, else the error importing it raised."""
    try:
        importlib.import_module(module)
    except Exception as error:  # any failure to import is what the line reports
        return error
    return None


def _said(error: Exception) -> str:
    return f"{type(error).__name__}: {error}"


def check_python() -> list[str]:
    if tuple(sys.version_info[:2]) >= MIN_PYTHON:
        return []
    return [f"Python {_version()} at {sys.executable} is too old: StaleFlow needs Python >= {MIN_PYTHON[0]}.{MIN_PYTHON[1]} "
            "(set PYTHON=/path/to/python3.11 or 3.12)"]


def check_torch(device: str) -> list[str]:
    error = _import_error("torch")
    if error:
        return [f"torch cannot be imported ({_said(error)}): the check trains with the machine's torch"]
    torch = sys.modules["torch"]
    if device == "cuda" and not torch.cuda.is_available():
        return [f"no CUDA device visible to torch {torch.__version__} (CUDA {torch.version.cuda}; CUDA_VISIBLE_DEVICES, "
                "the driver?); on a CPU use --device cpu --size tiny"]
    return []


def check_transformers() -> list[str]:
    error = _import_error("transformers")
    if error:
        return [f"transformers cannot be imported ({_said(error)}): pip install 'transformers>={MIN_TRANSFORMERS_MAJOR}'"]
    version = str(getattr(sys.modules["transformers"], "__version__", "0"))
    major = version.split(".")[0]
    if not major.isdigit() or int(major) < MIN_TRANSFORMERS_MAJOR:
        return [f"transformers {version} is too old: the loader and the bf16 export need transformers >= "
                f"{MIN_TRANSFORMERS_MAJOR} (pip install 'transformers>={MIN_TRANSFORMERS_MAJOR}')"]
    return []


def check_setuptools() -> list[str]:
    if _import_error("setuptools") is None:
        return []
    return [f"setuptools is missing: megatron.core imports it (through torch.utils.cpp_extension) and a fresh Python "
            f"{_version()} venv has none (pip install setuptools)"]


def wheels_for(folder: Path, distribution: str) -> list[str]:
    """The file names of ``distribution``'s wheels in ``folder`` (``megatron_core-0.16.1-cp312-...``)."""
    prefix = distribution.replace("-", "_") + "-"
    return sorted(p.name for p in folder.glob("*.whl") if p.name.lower().startswith(prefix)) if folder.is_dir() else []


def check_megatron(wheels: Path) -> list[str]:
    """megatron-core imports; or why not: not installed (with the wheels at hand, by Python), or the
    error an installed one raises."""
    error = _import_error("megatron.core")
    if error is None:
        return []
    if not (isinstance(error, ModuleNotFoundError) and error.name in ("megatron", "megatron.core")):
        return [f"megatron-core is installed but `import megatron.core` fails: {_said(error)}"]
    found = wheels_for(wheels, "megatron-core")
    if found:
        held = ", ".join(found)
        fix = f"none of them is for this Python ({python_tag()}): bring the {python_tag()} wheel"
    else:
        held = "none"
        fix = "bring it"
    return [f"megatron-core is not installed for Python {_version()} and the wheel folder {wheels} holds {held}: {fix}: "
            f"pip download --no-deps --only-binary=:all: --python-version {_version()} -d wheels {MEGATRON_WHEEL}"]


def check_driver() -> tuple[list[str], str]:
    """The NVIDIA driver against the CUDA runtime torch was built for (``torch.version.cuda``): a
    driver too old for it is refused, naming the fix; and one line saying both."""
    from staleflow.adapters.rlkit.cuda_driver import driver_problem, query_driver

    driver = query_driver()
    runtime = sys.modules["torch"].version.cuda
    said = f"driver {driver.describe()}, CUDA runtime of torch {runtime or 'none (a CPU build of torch)'}"
    problem = driver_problem(driver, runtime)
    return ([problem] if problem else []), said


def problems(backends: list[str], device: str, wheels: Path) -> tuple[list[str], str]:
    """Every reason the check cannot run here, one line each ([] when it can); and what the driver
    and the CUDA runtime are (empty when Python or torch stopped the check before)."""
    python = check_python()
    found = python + check_torch(device)
    driver, said = check_driver() if not python and "torch" in sys.modules else ([], "")  # torch imported
    found += driver + check_transformers()
    if "megatron" in backends:
        found += check_setuptools() + check_megatron(wheels)
    return found, said


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="fsdp,torch,megatron", help="comma-separated")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--wheels", type=Path, default=Path("wheels"))
    args = parser.parse_args(argv)
    found, driver = problems(args.backends.split(","), args.device, args.wheels)
    if driver:
        print(f"gpu-smoke preflight: {driver}")
    if found:
        print(f"gpu-smoke preflight FAILED ({len(found)}):", file=sys.stderr)
        for line in found:
            print("  - " + line, file=sys.stderr)
        return 2
    print(f"gpu-smoke preflight: ok (Python {_version()}, torch {sys.modules['torch'].__version__}, "
          f"transformers {sys.modules['transformers'].__version__})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
