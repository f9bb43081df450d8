from fizz import fizzbuzz


def test_fizzbuzz():
    assert [fizzbuzz(i) for i in (1, 3, 5, 15, 7)] == ["1", "Fizz", "Buzz", "FizzBuzz", "7"]
