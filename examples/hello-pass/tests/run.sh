#!/bin/sh
# Run the test suite; write the Harbor-style reward (1 on success, 0 otherwise); exit with its status.
mkdir -p /logs/verifier
if (cd /tests && python3 -m unittest -v test_fizzbuzz) 2>&1; then
    echo 1 > /logs/verifier/reward.txt
    exit 0
else
    status=$?
    echo 0 > /logs/verifier/reward.txt
    exit "$status"
fi
