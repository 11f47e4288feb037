"""A fixed, general-purpose passage for calibrating int8 activation ranges at load
(runner/quant/smoothing.py). Written for this project; mixed prose, numbers, lists and code, because
activation outliers show up in those. It is deliberately not any of the docs the quality test
measures perplexity on (tests/correctness/test_w8a8_int8.py)."""

CALIBRATION_TEXT = """\
The harbour town woke slowly. Fishing boats came back at dawn with nets full of herring and
mackerel, and by seven o'clock the market square smelled of salt, coffee and fresh bread. An
old man sold apples from a wooden cart; a child counted coins in her palm, twice, to be sure.

Question: A train leaves the station at 9:15 and travels 180 kilometres at an average speed of
72 km/h. When does it arrive?
Answer: 180 / 72 = 2.5 hours, so it arrives at 11:45.

Recipe for a simple tomato soup (serves 4):
1. Chop 2 onions and 3 cloves of garlic; soften them in olive oil for 5 minutes.
2. Add 800 g of tomatoes, 500 ml of stock, salt and pepper.
3. Simmer for 20 minutes, blend until smooth, and finish with fresh basil.

In 1905 Albert Einstein published four papers that changed physics: on the photoelectric
effect, Brownian motion, special relativity and the equivalence of mass and energy. The
photoelectric paper, which proposed that light comes in quanta, earned him the Nobel Prize.

def fibonacci(n: int) -> list[int]:
    \"\"\"Return the first n Fibonacci numbers.\"\"\"
    values = [0, 1]
    while len(values) < n:
        values.append(values[-1] + values[-2])
    return values[:n]

print(fibonacci(10))  # [0, 1, 1, 2, 3, 5, 8, 13, 21, 34]

SELECT customer_id, SUM(amount) AS total FROM orders
WHERE created_at >= '2024-01-01' GROUP BY customer_id ORDER BY total DESC LIMIT 10;

User: Can you explain what a hash table is?
Assistant: A hash table stores key-value pairs. A hash function maps each key to a bucket
index, so looking up a key usually takes constant time. When two keys land in the same
bucket (a collision), the table keeps both, for example in a short list, and compares keys.

Les enfants jouaient dans le parc pendant que leurs parents parlaient du temps qu'il ferait
demain. Der Zug nach Berlin hatte zwanzig Minuten Verspätung. El museo abre a las diez.

Photosynthesis converts light energy into chemical energy: carbon dioxide and water become
glucose and oxygen inside the chloroplasts of plant cells. Without it, almost no life on
Earth could exist, since nearly every food chain begins with a plant or an alga.
"""
