"""The spoken factual questions the offline profile is judged on, split once.

Each question has the words a right answer holds (any one of them counts; numbers spelled
out, as `loadtest.offline_quality.words` reads a reply). The split was made once, before any
choice was measured on it: the profile's prompt, its examples and the recognizer's decoding
are chosen on `TUNING` alone, and `TEST` is what is reported (README, docs/benchmarks.md). The
first twenty of `TUNING` are the questions earlier prompts were chosen on; no question of
`TEST` is, or is an example of, any prompt the project ships.
"""

from __future__ import annotations

Question = tuple[str, tuple[str, ...]]

TUNING: tuple[Question, ...] = (
    # the 20 the profile's prompt was chosen on (loadtest.offline_quality, 2026-12-01)
    ("What is the capital of France?", ("paris",)),
    ("How many days are there in a week?", ("seven",)),
    ("What is the opposite of hot?", ("cold",)),
    ("How many legs does a spider have?", ("eight",)),
    ("What color is the sky on a clear day?", ("blue",)),
    ("What is the capital of Japan?", ("tokyo",)),
    ("How many hours are there in a day?", ("twenty four",)),
    ("What is frozen water called?", ("ice",)),
    ("Which animal is known as the king of the jungle?", ("lion",)),
    ("What do bees make?", ("honey",)),
    ("How many months are there in a year?", ("twelve",)),
    ("What is the largest ocean on earth?", ("pacific",)),
    ("What is the capital of Italy?", ("rome",)),
    ("What gas do plants take in from the air?", ("carbon dioxide",)),
    ("How many sides does a triangle have?", ("three",)),
    ("What is the opposite of up?", ("down",)),
    ("Which season comes after winter?", ("spring",)),
    ("What is the capital of Germany?", ("berlin",)),
    ("How many minutes are there in an hour?", ("sixty",)),
    ("What do cows drink?", ("water",)),
    # and more of the same kind
    ("What is the capital of England?", ("london",)),
    ("How many legs does a dog have?", ("four",)),
    ("What color are bananas?", ("yellow",)),
    ("What is the opposite of big?", ("small", "little")),
    ("Which planet is closest to the sun?", ("mercury",)),
    ("What do you call a baby cat?", ("kitten",)),
    (
        "How many days are there in a year?",
        ("three hundred sixty five", "three hundred and sixty five"),
    ),
    ("What is the capital of Russia?", ("moscow",)),
    ("What do caterpillars turn into?", ("butterfly", "butterflies", "moth")),
    ("Which bird is a symbol of peace?", ("dove",)),
    ("What color is snow?", ("white",)),
    ("How many wheels does a car have?", ("four",)),
    ("What is the opposite of day?", ("night",)),
    ("What is the capital of Egypt?", ("cairo",)),
    ("What animal says moo?", ("cow",)),
    ("What is the largest planet in our solar system?", ("jupiter",)),
)
TEST: tuple[Question, ...] = (
    ("What is the capital of Sweden?", ("stockholm",)),
    ("How many legs does an insect have?", ("six",)),
    ("What color is coal?", ("black",)),
    ("What is the opposite of wet?", ("dry",)),
    ("What is the capital of China?", ("beijing",)),
    ("How many seconds are there in a minute?", ("sixty",)),
    ("What do you call a baby dog?", ("puppy",)),
    ("Which season comes after summer?", ("autumn", "fall")),
    ("What is the opposite of fast?", ("slow",)),
    ("What is the capital of Canada?", ("ottawa",)),
    ("How many arms does an octopus have?", ("eight",)),
    ("What color are strawberries?", ("red",)),
    ("Which animal has a long neck and eats leaves from trees?", ("giraffe",)),
    ("What is the capital of Greece?", ("athens",)),
    ("How many weeks are there in a year?", ("fifty two",)),
    ("What is the opposite of old?", ("young", "new")),
    ("What do spiders spin?", ("web", "webs", "silk")),
    ("Which planet is known as the red planet?", ("mars",)),
    ("What is the capital of Australia?", ("canberra",)),
    ("How many legs does a bird have?", ("two",)),
    ("What is the opposite of open?", ("closed", "shut")),
    ("What is the opposite of left?", ("right",)),
    ("Which animal is the largest on earth?", ("blue whale", "whale")),
    ("What is the capital of Ireland?", ("dublin",)),
    ("How many players are there on a soccer team?", ("eleven",)),
    ("What color is a ripe tomato?", ("red",)),
    ("What do you call a baby cow?", ("calf",)),
    ("Which metal is liquid at room temperature?", ("mercury",)),
    ("What is the capital of Portugal?", ("lisbon",)),
    ("How many days are there in February in a leap year?", ("twenty nine",)),
    ("What is the opposite of full?", ("empty",)),
    ("Which star is closest to the earth?", ("sun",)),
    ("What do pandas eat?", ("bamboo",)),
    ("What is the capital of Norway?", ("oslo",)),
    ("How many continents are there?", ("seven",)),
    ("What is the boiling point of water in Celsius?", ("one hundred", "hundred")),
)

PARTS = {"tuning": TUNING, "test": TEST}
