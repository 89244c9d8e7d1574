"""An adapter package imported without its framework names the extra that installs it."""

import subprocess
import sys

import pytest

# adapter package: (a framework it needs, the extra that installs it)
MISSING = {
    "lightning_ckpt": ("lightning", "lightning"),
    "accelerate_ckpt": ("accelerate", "accelerate"),
    "transformers_ckpt": ("transformers", "transformers"),
}


@pytest.mark.parametrize("adapter", sorted(MISSING))
def test_an_adapter_without_its_framework_names_the_extra(adapter):
    framework, extra = MISSING[adapter]
    # ``None`` in sys.modules makes ``import framework`` raise ImportError, as when it is absent.
    code = (f"import sys; sys.modules[{framework!r}] = None\n"
            f"try:\n    import {adapter}\nexcept ImportError as exc:\n    print(exc)\n"
            "else:\n    print('imported')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert f"{adapter} needs the {framework!r} package" in out, out
    assert f'pip install "diffckpt[{extra}]"' in out, out


@pytest.mark.parametrize("adapter", sorted(MISSING))
def test_an_adapter_with_its_framework_imports(adapter):
    out = subprocess.run([sys.executable, "-c", f"import {adapter}; print({adapter}.__all__)"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
