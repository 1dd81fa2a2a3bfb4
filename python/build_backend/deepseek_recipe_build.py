"""PEP 517 build backend of deepseek_recipe, standard library only.

`pip install .` works offline because pyproject.toml requires nothing: this backend configures and builds the
CMake target `deepseek_recipe_python` (src/python) with the interpreter that runs it, then writes the wheel
itself (WHEEL, METADATA, RECORD with sha256 digests). The wheel holds python/deepseek_recipe/*.py, the
extension module and DeepSeek-V3's tokenizer (models/deepseek-v3, fetched by `make setup`).

Build settings (pip --config-settings KEY=VALUE, or the environment):
  build-dir   / DEEPINFER_PYTHON_BUILD_DIR   a CMake build tree to build in and keep (default: a temporary
              one). An existing tree keeps its own configuration (only -DDEEPINFER_PYTHON=ON and the
              interpreter are added), so `make test` reuses the main build; a new one is configured with
              -DDEEPINFER_PYTHON_ONLY=ON (only core, recipe and the module: no engine, server or test deps).
  cmake-args  / DEEPINFER_PYTHON_CMAKE_ARGS  extra arguments for the CMake configure step.
Parallelism follows CMAKE_BUILD_PARALLEL_LEVEL (default: all cores).
"""
import base64
import csv
import glob
import hashlib
import io
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = "deepseek_recipe"
TARGET = "deepseek_recipe_python"
TOKENIZER_DIR = os.path.join(ROOT, "models", "deepseek-v3")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "LICENSE.npm-package")


# ---- metadata ------------------------------------------------------------------------------------------------

def _project():
    """The [project] table of pyproject.toml (tomllib where available, else the few keys we use)."""
    path = os.path.join(ROOT, "pyproject.toml")
    try:
        import tomllib
        with open(path, "rb") as f:
            return tomllib.load(f)["project"]
    except ImportError:
        text = open(path, encoding="utf-8").read()
        section = text.split("[project]", 1)[1].split("\n[", 1)[0]
        return {k: v for k, v in re.findall(r'^(\w[\w-]*)\s*=\s*"([^"]*)"', section, re.M)}


def _names():
    project = _project()
    name = project["name"]
    return name, re.sub(r"[-_.]+", "_", name).lower(), project["version"], project


def _metadata_text():
    name, _, version, project = _names()
    lines = ["Metadata-Version: 2.1", "Name: " + name, "Version: " + version]
    if project.get("description"):
        lines.append("Summary: " + project["description"])
    if project.get("requires-python"):
        lines.append("Requires-Python: " + project["requires-python"])
    license_ = project.get("license")
    if isinstance(license_, dict) and license_.get("text"):
        lines.append("License: " + license_["text"])
    for extra, requirements in (project.get("optional-dependencies") or {}).items():
        lines.append("Provides-Extra: " + extra)
        lines.extend('Requires-Dist: %s; extra == "%s"' % (r, extra) for r in requirements)
    return "\n".join(lines) + "\n"


def _tag():
    interpreter = "cp" if sys.implementation.name == "cpython" else sys.implementation.name[:2]
    version = "%d%d" % sys.version_info[:2]
    abi = interpreter + version + getattr(sys, "abiflags", "")
    platform = re.sub(r"[-.]", "_", sysconfig.get_platform())
    return "%s%s-%s-%s" % (interpreter, version, abi, platform)


def _dist_info_files():
    _, dist, version, _ = _names()
    wheel = "Wheel-Version: 1.0\nGenerator: deepseek_recipe_build\nRoot-Is-Purelib: false\nTag: %s\n" % _tag()
    return "%s-%s.dist-info" % (dist, version), {"METADATA": _metadata_text(), "WHEEL": wheel}


def _write_dist_info(directory):
    name, files = _dist_info_files()
    os.makedirs(os.path.join(directory, name), exist_ok=True)
    for file, text in files.items():
        with open(os.path.join(directory, name, file), "w", encoding="utf-8") as f:
            f.write(text)
    return name


# ---- the CMake build -------------------------------------------------------------------------------------------

def _setting(config_settings, key, env):
    value = (config_settings or {}).get(key)
    return value if value else os.environ.get(env)


def _run(command):
    print("deepseek_recipe_build: " + " ".join(shlex.quote(c) for c in command), file=sys.stderr, flush=True)
    subprocess.run(command, check=True, stdout=sys.stderr)


def _check_tokenizer():
    missing = [f for f in TOKENIZER_FILES[:2] if not os.path.isfile(os.path.join(TOKENIZER_DIR, f))]
    if missing:
        raise RuntimeError("%s is missing from %s: the wheel ships DeepSeek-V3's tokenizer; run `make setup` "
                           "(scripts/setup.sh fetches it) and build again" % (", ".join(missing), TOKENIZER_DIR))


class _BuildTree:
    """The CMake build tree: the one the settings name (kept), else a temporary one (removed on exit)."""

    def __init__(self, config_settings):
        path = _setting(config_settings, "build-dir", "DEEPINFER_PYTHON_BUILD_DIR")
        self.temporary = not path
        self.path = tempfile.mkdtemp(prefix="deepseek_recipe_build-") if self.temporary else os.path.abspath(path)

    def __enter__(self):
        return self.path

    def __exit__(self, *exc):
        if self.temporary:
            shutil.rmtree(self.path, ignore_errors=True)


def _build_module(config_settings, build_dir):
    """Builds the extension module in build_dir; returns its path."""
    if shutil.which("cmake") is None:
        raise RuntimeError("cmake is not installed: run `make setup` (or apt-get install cmake ninja-build g++)")
    configure = ["cmake", "-S", ROOT, "-B", build_dir]
    if not os.path.isfile(os.path.join(build_dir, "CMakeCache.txt")):
        if shutil.which("ninja"):
            configure += ["-G", "Ninja"]
        configure += ["-DCMAKE_BUILD_TYPE=Release", "-DDEEPINFER_PYTHON_ONLY=ON", "-DDEEPINFER_WERROR=OFF"]
    configure += ["-DDEEPINFER_PYTHON=ON", "-DPYTHON_EXECUTABLE=" + sys.executable,
                  "-DPython_EXECUTABLE=" + sys.executable]
    configure += shlex.split(_setting(config_settings, "cmake-args", "DEEPINFER_PYTHON_CMAKE_ARGS") or "")
    _run(configure)
    jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL") or str(os.cpu_count() or 1)
    _run(["cmake", "--build", build_dir, "--target", TARGET, "--parallel", jobs])
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    built = os.path.join(build_dir, "src", "python", "_core" + suffix)
    if not os.path.isfile(built):
        found = glob.glob(os.path.join(build_dir, "src", "python", "_core*"))
        raise RuntimeError("the build produced %s, not %s: the CMake build tree was configured for another "
                           "Python than %s" % (found, built, sys.executable))
    return built


def _package_files(module):
    """(archive name, source path) of every file of the package."""
    files = []
    source = os.path.join(ROOT, "python", PACKAGE)
    for name in sorted(os.listdir(source)):
        if name.endswith(".py"):
            files.append((PACKAGE + "/" + name, os.path.join(source, name)))
    files.append((PACKAGE + "/" + os.path.basename(module), module))
    for name in TOKENIZER_FILES:
        path = os.path.join(TOKENIZER_DIR, name)
        if os.path.isfile(path):
            files.append((PACKAGE + "/tokenizers/deepseek-v3/" + name, path))
    return files


# ---- the wheel -------------------------------------------------------------------------------------------------

def _record_hash(data):
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _write_wheel(wheel_directory, entries):
    """entries: (archive name, bytes). Adds the dist-info files and RECORD; returns the wheel's file name."""
    _, dist, version, _ = _names()
    dist_info, info_files = _dist_info_files()
    entries = list(entries) + [(dist_info + "/" + n, t.encode("utf-8")) for n, t in info_files.items()]
    wheel_name = "%s-%s-%s.whl" % (dist, version, _tag())
    record_name = dist_info + "/RECORD"
    record = io.StringIO()
    writer = csv.writer(record, lineterminator="\n")
    for name, data in entries:
        writer.writerow([name, _record_hash(data), len(data)])
    writer.writerow([record_name, "", ""])
    entries.append((record_name, record.getvalue().encode("utf-8")))
    os.makedirs(wheel_directory, exist_ok=True)
    path = os.path.join(wheel_directory, wheel_name)
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for name, data in entries:
            info = zipfile.ZipInfo(name, date_time=(2025, 1, 1, 0, 0, 0))
            info.external_attr = (0o755 if name.endswith(".so") else 0o644) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            archive.writestr(info, data)
    return wheel_name


def _read(path):
    with open(path, "rb") as f:
        return f.read()


# ---- PEP 517 / PEP 660 hooks -------------------------------------------------------------------------------

def get_requires_for_build_wheel(config_settings=None):
    return []


def get_requires_for_build_sdist(config_settings=None):
    return []


def get_requires_for_build_editable(config_settings=None):
    return []


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    return _write_dist_info(metadata_directory)


def prepare_metadata_for_build_editable(metadata_directory, config_settings=None):
    return _write_dist_info(metadata_directory)


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    _check_tokenizer()
    with _BuildTree(config_settings) as build_dir:
        module = _build_module(config_settings, build_dir)
        return _write_wheel(wheel_directory, [(name, _read(path)) for name, path in _package_files(module)])


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    """The package stays in python/deepseek_recipe (a .pth file points there); the module and the tokenizer
    are copied next to its sources (git-ignored). Rebuild after changing C++."""
    _check_tokenizer()
    source = os.path.join(ROOT, "python", PACKAGE)
    with _BuildTree(config_settings) as build_dir:
        module = _build_module(config_settings, build_dir)
        for old in glob.glob(os.path.join(source, "_core*")):
            os.remove(old)
        shutil.copy2(module, source)
    os.makedirs(os.path.join(source, "tokenizers", "deepseek-v3"), exist_ok=True)
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(TOKENIZER_DIR, name)):
            shutil.copy2(os.path.join(TOKENIZER_DIR, name), os.path.join(source, "tokenizers", "deepseek-v3", name))
    pth = (os.path.join(ROOT, "python") + "\n").encode("utf-8")
    return _write_wheel(wheel_directory, [(PACKAGE + "_editable.pth", pth)])


def build_sdist(sdist_directory, config_settings=None):
    """Sources the module needs (top-level CMake, include/, src/core, src/recipe, src/python, python/) and the
    tokenizer when present, so that the sdist builds on its own."""
    _, dist, version, _ = _names()
    base = "%s-%s" % (dist, version)
    paths = ["pyproject.toml", "CMakeLists.txt", "README.md"]
    for directory in ("include", "src/core", "src/recipe", "src/python", "python"):
        for folder, _, files in os.walk(os.path.join(ROOT, directory)):
            for file in files:
                if "__pycache__" in folder or file.startswith("_core") or file.endswith(".pyc"):
                    continue
                paths.append(os.path.relpath(os.path.join(folder, file), ROOT))
    paths = [p for p in paths if "/tokenizers/" not in p.replace(os.sep, "/")]
    paths += [os.path.join("models", "deepseek-v3", f) for f in TOKENIZER_FILES
              if os.path.isfile(os.path.join(TOKENIZER_DIR, f))]
    os.makedirs(sdist_directory, exist_ok=True)
    file_name = base + ".tar.gz"
    with tarfile.open(os.path.join(sdist_directory, file_name), "w:gz", format=tarfile.PAX_FORMAT) as archive:
        for path in sorted(set(paths)):
            archive.add(os.path.join(ROOT, path), arcname=base + "/" + path, recursive=False)
        pkg_info = _metadata_text().encode("utf-8")
        info = tarfile.TarInfo(base + "/PKG-INFO")
        info.size = len(pkg_info)
        archive.addfile(info, io.BytesIO(pkg_info))
    return file_name
