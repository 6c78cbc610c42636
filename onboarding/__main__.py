"""`python -m onboarding` is `onboard`."""

import sys

from onboarding.cli import main

sys.exit(main())
