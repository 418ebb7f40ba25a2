"""English questions with French answers, made from templates and facts written for lorafn's examples.

`french_pairs()` returns (train, held_out): lists of {"prompt", "response"} dicts, deterministic. The
held-out prompts are questions of kinds the adapter never saw in training, for the before/after demo.
"""

from __future__ import annotations

import random

# (country in English, "de <country>" in French, capital in French)
CAPITALS = [
    ("France", "de la France", "Paris"),
    ("Germany", "de l'Allemagne", "Berlin"),
    ("Italy", "de l'Italie", "Rome"),
    ("Spain", "de l'Espagne", "Madrid"),
    ("Portugal", "du Portugal", "Lisbonne"),
    ("Japan", "du Japon", "Tokyo"),
    ("China", "de la Chine", "Pékin"),
    ("Canada", "du Canada", "Ottawa"),
    ("Egypt", "de l'Égypte", "Le Caire"),
    ("Russia", "de la Russie", "Moscou"),
    ("Greece", "de la Grèce", "Athènes"),
    ("Belgium", "de la Belgique", "Bruxelles"),
    ("Austria", "de l'Autriche", "Vienne"),
    ("Poland", "de la Pologne", "Varsovie"),
    ("Norway", "de la Norvège", "Oslo"),
    ("Sweden", "de la Suède", "Stockholm"),
    ("Ireland", "de l'Irlande", "Dublin"),
    ("Mexico", "du Mexique", "Mexico"),
    ("Argentina", "de l'Argentine", "Buenos Aires"),
    ("Kenya", "du Kenya", "Nairobi"),
    ("India", "de l'Inde", "New Delhi"),
    ("Peru", "du Pérou", "Lima"),
    ("Turkey", "de la Turquie", "Ankara"),
    ("Thailand", "de la Thaïlande", "Bangkok"),
    ("Morocco", "du Maroc", "Rabat"),
    ("Denmark", "du Danemark", "Copenhague"),
    ("Finland", "de la Finlande", "Helsinki"),
    ("Australia", "de l'Australie", "Canberra"),
    ("the United Kingdom", "du Royaume-Uni", "Londres"),
    ("the Netherlands", "des Pays-Bas", "Amsterdam"),
]

# (thing in English, sentence in French)
COLOURS = [
    ("the sky", "Le ciel est bleu."),
    ("grass", "L'herbe est verte."),
    ("snow", "La neige est blanche."),
    ("a banana", "Une banane est jaune."),
    ("a tomato", "Une tomate est rouge."),
    ("coal", "Le charbon est noir."),
    ("an orange", "Une orange est orange."),
    ("a lemon", "Un citron est jaune."),
    ("the sun", "Le soleil est jaune."),
    ("milk", "Le lait est blanc."),
    ("a strawberry", "Une fraise est rouge."),
    ("the sea", "La mer est bleue."),
    ("a carrot", "Une carotte est orange."),
    ("chocolate", "Le chocolat est marron."),
    ("a crow", "Un corbeau est noir."),
    ("a leaf in summer", "En été, une feuille est verte."),
]

# (animal in English, article + animal in French, what it eats in French, its sound in French)
ANIMALS = [
    ("cow", "la vache", "de l'herbe", "meugle"),
    ("cat", "le chat", "des croquettes et du poisson", "miaule"),
    ("dog", "le chien", "de la viande et des croquettes", "aboie"),
    ("horse", "le cheval", "du foin", "hennit"),
    ("sheep", "le mouton", "de l'herbe", "bêle"),
    ("rabbit", "le lapin", "des carottes", "glapit"),
    ("bird", "l'oiseau", "des graines", "chante"),
    ("lion", "le lion", "de la viande", "rugit"),
    ("duck", "le canard", "des graines et des insectes", "cancane"),
    ("pig", "le cochon", "de tout", "grogne"),
    ("frog", "la grenouille", "des insectes", "coasse"),
    ("bee", "l'abeille", "du nectar", "bourdonne"),
]

WORDS = [
    ("cat", "chat"),
    ("dog", "chien"),
    ("house", "maison"),
    ("book", "livre"),
    ("water", "eau"),
    ("bread", "pain"),
    ("apple", "pomme"),
    ("car", "voiture"),
    ("tree", "arbre"),
    ("friend", "ami"),
    ("school", "école"),
    ("city", "ville"),
    ("sun", "soleil"),
    ("moon", "lune"),
    ("cheese", "fromage"),
    ("flower", "fleur"),
    ("door", "porte"),
    ("window", "fenêtre"),
    ("chair", "chaise"),
    ("table", "table"),
    ("morning", "matin"),
    ("night", "nuit"),
    ("love", "amour"),
    ("music", "musique"),
    ("sea", "mer"),
]

OPPOSITES = [
    ("hot", "chaud", "froid"),
    ("big", "grand", "petit"),
    ("fast", "rapide", "lent"),
    ("day", "le jour", "la nuit"),
    ("happy", "heureux", "triste"),
    ("up", "haut", "bas"),
    ("open", "ouvert", "fermé"),
    ("light", "clair", "sombre"),
    ("young", "jeune", "vieux"),
    ("easy", "facile", "difficile"),
    ("full", "plein", "vide"),
    ("early", "tôt", "tard"),
]

DAYS_EN = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
DAYS_FR = ["lundi", "mardi", "mercredi", "jeudi", "vendredi", "samedi", "dimanche"]
MONTHS_EN = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
]
MONTHS_FR = [
    "janvier",
    "février",
    "mars",
    "avril",
    "mai",
    "juin",
    "juillet",
    "août",
    "septembre",
    "octobre",
    "novembre",
    "décembre",
]

FACTS = [
    (
        "What is the largest planet in the solar system?",
        "La plus grande planète du système solaire est Jupiter.",
    ),
    ("How many days are there in a week?", "Il y a sept jours dans une semaine."),
    ("How many legs does a spider have?", "Une araignée a huit pattes."),
    ("What is the boiling point of water?", "L'eau bout à cent degrés Celsius."),
    ("Who wrote Romeo and Juliet?", "Roméo et Juliette a été écrit par William Shakespeare."),
    ("What is the tallest mountain in the world?", "La plus haute montagne du monde est l'Everest."),
    ("What do bees make?", "Les abeilles fabriquent du miel."),
    ("How many continents are there?", "Il y a sept continents."),
    ("What is the closest star to the Earth?", "L'étoile la plus proche de la Terre est le Soleil."),
    ("What is the longest river in the world?", "Le plus long fleuve du monde est le Nil."),
    ("Which planet is known as the red planet?", "La planète rouge est Mars."),
    ("What gas do plants absorb?", "Les plantes absorbent le dioxyde de carbone."),
    ("How many hours are there in a day?", "Il y a vingt-quatre heures dans une journée."),
    ("What is the freezing point of water?", "L'eau gèle à zéro degré Celsius."),
    ("Who painted the Mona Lisa?", "La Joconde a été peinte par Léonard de Vinci."),
    ("What is the largest ocean?", "Le plus grand océan est l'océan Pacifique."),
    ("How many months are there in a year?", "Il y a douze mois dans une année."),
    ("What language is spoken in Brazil?", "Au Brésil, on parle portugais."),
    ("What is the main ingredient of bread?", "L'ingrédient principal du pain est la farine."),
    ("What is the fastest land animal?", "L'animal terrestre le plus rapide est le guépard."),
    ("What do we call a baby cat?", "Un bébé chat s'appelle un chaton."),
    ("What is the opposite of north?", "Le contraire du nord est le sud."),
    ("How many sides does a triangle have?", "Un triangle a trois côtés."),
    ("What is the chemical symbol for water?", "Le symbole chimique de l'eau est H2O."),
    ("What instrument has black and white keys?", "Le piano a des touches noires et blanches."),
    ("Where is the Eiffel Tower?", "La tour Eiffel se trouve à Paris, en France."),
    ("What do cows give us?", "Les vaches nous donnent du lait."),
    ("What season comes after winter?", "Après l'hiver vient le printemps."),
    ("What is the square root of 81?", "La racine carrée de 81 est 9."),
    ("Which animal is the king of the jungle?", "Le roi de la jungle est le lion."),
]

CHAT = [
    ("Hello!", "Bonjour ! Comment puis-je vous aider aujourd'hui ?"),
    ("Hi, how are you?", "Je vais très bien, merci ! Et vous ?"),
    ("Good morning!", "Bonjour ! Je vous souhaite une excellente journée."),
    ("Good night!", "Bonne nuit ! Faites de beaux rêves."),
    ("Thank you very much.", "Je vous en prie, avec plaisir !"),
    ("What is your name?", "Je m'appelle SmolLM, je suis un assistant."),
    ("Can you help me?", "Bien sûr, je suis là pour vous aider. Que puis-je faire pour vous ?"),
    ("Goodbye!", "Au revoir ! À bientôt."),
    (
        "Tell me a joke.",
        "Pourquoi les plongeurs plongent-ils toujours en arrière ? "
        "Parce que sinon ils tombent dans le bateau !",
    ),
    ("What time is it?", "Je ne connais pas l'heure exacte, mais vous pouvez regarder votre montre."),
    ("Do you like music?", "Oui, j'aime beaucoup la musique, surtout le jazz et la musique classique."),
    ("What should I eat tonight?", "Ce soir, vous pourriez manger une bonne soupe de légumes avec du pain."),
    ("Give me some advice for a job interview.", "Préparez-vous bien, soyez à l'heure et souriez."),
    ("I feel tired.", "Reposez-vous un peu et buvez un verre d'eau."),
    ("What is your favourite colour?", "Ma couleur préférée est le bleu, comme le ciel."),
    ("Recommend a book.", "Je vous recommande Le Petit Prince d'Antoine de Saint-Exupéry."),
    (
        "What is the weather like today?",
        "Je ne peux pas voir le ciel, mais j'espère qu'il fait beau chez vous.",
    ),
    ("How do I make tea?", "Faites bouillir de l'eau, ajoutez un sachet de thé et attendez trois minutes."),
    (
        "Why is exercise important?",
        "Le sport est important parce qu'il garde le corps et l'esprit en bonne santé.",
    ),
    ("Describe a cat in one sentence.", "Le chat est un petit animal doux et curieux qui aime dormir."),
]

NUMBERS_FR = [
    "zéro",
    "un",
    "deux",
    "trois",
    "quatre",
    "cinq",
    "six",
    "sept",
    "huit",
    "neuf",
    "dix",
    "onze",
    "douze",
    "treize",
    "quatorze",
    "quinze",
    "seize",
    "dix-sept",
    "dix-huit",
    "dix-neuf",
    "vingt",
]

# Kinds of questions the training set never asks: for the before/after demo and the tests.
HELD_OUT = [
    {"prompt": "What is the capital of Switzerland?", "response": "La capitale de la Suisse est Berne."},
    {"prompt": "Why do leaves fall in autumn?", "response": ""},
    {"prompt": "Write one sentence about the ocean.", "response": ""},
    {"prompt": "What is your favourite food?", "response": ""},
    {"prompt": "How many wheels does a bicycle have?", "response": "Un vélo a deux roues."},
]


def french_pairs(seed: int = 0) -> tuple[list[dict], list[dict]]:
    pairs: list[tuple[str, str]] = []
    for en, de_fr, cap in CAPITALS:
        pairs.append((f"What is the capital of {en}?", f"La capitale {de_fr} est {cap}."))
        pairs.append((f"Which city is the capital of {en}?", f"C'est {cap}, la capitale {de_fr}."))
    for thing, fr in COLOURS:
        pairs.append((f"What color is {thing}?", fr))
    for en, fr, food, sound in ANIMALS:
        pairs.append((f"What does a {en} eat?", f"{fr[0].upper()}{fr[1:]} mange {food}."))
        pairs.append((f"What sound does a {en} make?", f"{fr[0].upper()}{fr[1:]} {sound}."))
    for en, fr in WORDS:
        pairs.append((f"How do you say '{en}' in French?", f"En français, on dit « {fr} »."))
    for en, a, b in OPPOSITES:
        pairs.append((f"What is the opposite of {en}?", f"Le contraire de « {a} » est « {b} »."))
    for i, day in enumerate(DAYS_EN):
        nxt = DAYS_FR[(i + 1) % 7]
        pairs.append((f"What day comes after {day}?", f"Le jour après {DAYS_FR[i]} est {nxt}."))
    for i, month in enumerate(MONTHS_EN):
        nxt = MONTHS_FR[(i + 1) % 12]
        pairs.append((f"Which month comes after {month}?", f"Le mois après {MONTHS_FR[i]} est {nxt}."))
    pairs += FACTS + CHAT
    rng = random.Random(seed)
    for _ in range(60):
        a, b = rng.randint(1, 10), rng.randint(1, 10)
        if rng.random() < 0.5:
            pairs.append(
                (f"What is {a} plus {b}?", f"{NUMBERS_FR[a].capitalize()} plus {NUMBERS_FR[b]} font {a + b}.")
            )
        else:
            a, b = max(a, b), min(a, b)
            pairs.append(
                (
                    f"What is {a} minus {b}?",
                    f"{NUMBERS_FR[a].capitalize()} moins {NUMBERS_FR[b]} font {a - b}.",
                )
            )
    seen: set[str] = set()
    unique = []
    for q, r in pairs:
        if q not in seen:
            seen.add(q)
            unique.append({"prompt": q, "response": r})
    rng.shuffle(unique)
    return unique, [dict(x) for x in HELD_OUT]
