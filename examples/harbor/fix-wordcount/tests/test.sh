#!/bin/bash
# The fraction of the three tests that pass, written last. Fewer than three collected is 0.
cd /app
python -m pytest -q -p no:cacheprovider --junitxml=/logs/verifier/junit.xml /tests/test_outputs.py
python - <<'PY' > /logs/verifier/reward.txt
import xml.etree.ElementTree as ET
try:
    suite = ET.parse("/logs/verifier/junit.xml").getroot().find("testsuite")
    total = int(suite.get("tests"))
    bad = int(suite.get("failures")) + int(suite.get("errors")) + int(suite.get("skipped"))
    print((total - bad) / total if total == 3 else 0)
except Exception:
    print(0)
PY
