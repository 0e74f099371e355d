"""Loading a float64 reference module for tests. The references are pure NumPy, but `import kspec`
loads the compiled extension: where that is not built (a CPU-only checkout), the module is loaded from
its file so the spec stays testable."""
import importlib
import importlib.util
import pathlib


def load_reference(name: str):
    try:
        return importlib.import_module(f"kspec.reference.{name}")
    except ImportError:
        path = pathlib.Path(__file__).resolve().parents[2] / f"python/kspec/reference/{name}.py"
        spec = importlib.util.spec_from_file_location(f"_kspec_reference_{name}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
