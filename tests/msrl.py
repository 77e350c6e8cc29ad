"""`MSRL`: the command line that runs the `msrl` CLI in a subprocess with this interpreter (no PATH lookup, no
console script needed): `subprocess.run([*MSRL, "validate", CONFIG], cwd=REPO)`."""
import sys

MSRL = (sys.executable, "-m", "megatron_sparse_rl.tools.cli")
