"""The example in examples/ (and so the README's) runs as written."""
import os
import subprocess
import sys

import pytest

from conftest import needs_torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@needs_torch
def test_torch_example_runs():
    result = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "torch_example.py")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "step 2: loss" in result.stdout
    assert "decode matches prefill: True" in result.stdout
    assert "selected blocks of the last token: [0, 1, 2, 3]" in result.stdout, result.stdout


@needs_torch
@pytest.mark.parametrize("document", ["README.md", os.path.join("docs", "python.md")])
def test_docs_example_runs_as_written(document):
    """The PyTorch example of the README and of docs/python.md: the block after the <!-- example --> mark."""
    with open(os.path.join(ROOT, document)) as f:
        text = f.read()
    start = text.index("```python", text.index("<!-- example -->")) + len("```python")
    code = text[start:text.index("```", start)]
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "torch.Size([2, 128, 256]) torch.Size([100, 4, 32])" in result.stdout
