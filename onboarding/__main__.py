"""`python -m onboarding` is `onboard`."""

import sys

from onboarding.cli.main import main

sys.exit(main())
