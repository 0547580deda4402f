from k3sys._units import format_bytes


def test_format_bytes_three_figures_in_binary_units():
    assert format_bytes(0) == "0 B" and format_bytes(999) == "999 B"
    assert format_bytes(1000) == "0.977 KiB"  # 1000 / 1024
    assert format_bytes(429 << 20) == "429 MiB"
    assert format_bytes(3.38 * (1 << 30)) == "3.38 GiB"
    assert format_bytes(12.5 * (1 << 20)) == "12.5 MiB"
    assert format_bytes(5000 * (1 << 40)) == "5000 TiB"  # TiB is the largest unit


def test_units_imports_no_other_design():
    import subprocess
    import sys

    code = "import sys, k3sys._units; print(sorted(m for m in sys.modules if m.startswith(('k3sys.', 'torch'))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['k3sys._units']"
