"""`h33_mla_profile.py --bwd` under the name the earlier calls used (docs/LOG.md cites it):

    python3 .ci/h200/h33_mla_bwd_profile.py 8192 $OUT/mla_bwd_profile.json
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from h33_mla_profile import main  # noqa: E402

if __name__ == "__main__":
    main(backward=True)
