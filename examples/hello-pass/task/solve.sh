#!/bin/sh
# The "agent": write a solution, then run it once to produce /work/output.txt.
set -e
cat > /work/fizzbuzz.py <<'PY'
"""FizzBuzz, as written by the agent."""


def fizzbuzz(n: int) -> str:
    if n % 15 == 0:
        return "FizzBuzz"
    if n % 3 == 0:
        return "Fizz"
    if n % 5 == 0:
        return "Buzz"
    return str(n)


if __name__ == "__main__":
    for i in range(1, 16):
        print(f"{i}: {fizzbuzz(i)}")
PY
python3 /work/fizzbuzz.py > /work/output.txt
echo "wrote /work/fizzbuzz.py and /work/output.txt"
