"""The task's test suite: runs inside the VM against the agent's /work/fizzbuzz.py."""

import sys
import unittest

sys.path.insert(0, "/work")

from fizzbuzz import fizzbuzz  # noqa: E402


class FizzBuzzTest(unittest.TestCase):
    def test_numbers(self):
        self.assertEqual([fizzbuzz(i) for i in (1, 2, 4, 7)], ["1", "2", "4", "7"])

    def test_fizz_and_buzz(self):
        self.assertEqual([fizzbuzz(3), fizzbuzz(5), fizzbuzz(9), fizzbuzz(10)], ["Fizz", "Buzz", "Fizz", "Buzz"])

    def test_fizzbuzz(self):
        self.assertEqual([fizzbuzz(15), fizzbuzz(30)], ["FizzBuzz", "FizzBuzz"])


if __name__ == "__main__":
    unittest.main()
