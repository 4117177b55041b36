"""Every Metal kernel in the tree must have run through the emulator in this test session.

conftest.py moves this test to the end of the run; it is meaningful when the whole suite runs
(`python -m pytest`), and fails with the list of kernels no test emulated otherwise.
"""

import metal_kernels
from metalnn.kernels import launch


def test_every_metal_kernel_was_emulated():
    all_kernels = {(fam, name) for fam in metal_kernels.families() for name in metal_kernels.load(fam).kernels}
    assert all_kernels, "no kernels found in metal_kernels/"
    missing = sorted(all_kernels - launch.EMULATED)
    assert not missing, f"kernels never run through the emulator by the tests: {missing}"
