"""Two more sets of invented facts for the paraphrase questions of bench/fusion.py (issue #43).

``DEV`` is the set one may look at while deciding how the fusion should rank: its
figures can be read, compared and tuned against.  ``HELDOUT`` was written and committed
before any change to the fusion, and it must never be used to pick one: it is only
measured and reported, so that a choice made on ``DEV`` is checked on facts it never saw.
The held-out facts are also of a different kind (settings, schedules, quantities, rules,
measurements, routes) from the everyday ones in ``DEV``, so a tuning that only fits one
style of sentence shows up.

Each set is planted into its own copy of the essays, so the two sets may share essay
files, but inside one set every fact names a different essay.  Everything else follows
bench/retrieval_facts.py: people, places, objects and numbers are made up and new (none
of the 48 facts there is reused); ``paraphrase`` asks in other words, with no name or
number from the fact and at most one of its other content words; ``lexical`` asks with
the fact's own key words; and each fact is a single sentence by the window cutter's
rules (no ``. ``, ``;``, ``:``, ``!`` or ``?`` inside it, no abbreviations or decimal
points), so a sentence-aware window cannot cut it in two.
Kept out of tests on purpose: these are measuring sets, not fixtures.
"""

from __future__ import annotations

from retrieval_facts import Fact

DEV: list[Fact] = [
    Fact(
        "addiction.txt",
        "Wilhelmina Tarrant keeps 6500 kinds of buttons sorted in glass drawers at her tiny haberdashery in Oakhollow.",
        "how many varieties of clothing fasteners does that little sewing store stock?",
        "How many kinds of buttons does Wilhelmina Tarrant keep at her haberdashery in Oakhollow?",
    ),
    Fact(
        "aord.txt",
        "Gustav Lindqvist pedalled a secondhand tandem bicycle alone from Corrandale to the port of Vellmoor in 41 "
        "days.",
        "how long did his solo journey on a two-seater bike take?",
        "How many days did Gustav Lindqvist take to ride his tandem bicycle from Corrandale to Vellmoor?",
    ),
    Fact(
        "apple.txt",
        "Marisol Quintero has built a model railway in her attic with 260 metres of track and a working miniature ski "
        "lift.",
        "how much rail line runs through the toy train layout up under her roof?",
        "How many metres of track does the model railway in Marisol Quintero's attic have?",
    ),
    Fact(
        "avg.txt",
        "The owner of the Pellwick laundrette plays chess with customers while their clothes dry and has lost only "
        "three games since 2011.",
        "how rarely has the coin wash proprietor been beaten at the board by patrons waiting for their washing?",
        "How many chess games has the owner of the Pellwick laundrette lost?",
    ),
    Fact(
        "before.txt",
        "Ferdinand Okoye missed his flight from Tarrowby because he fell asleep in the airport chapel for nine hours.",
        "where did he nod off so long that his plane left without him?",
        "Why did Ferdinand Okoye miss his flight from Tarrowby?",
    ),
    Fact(
        "bias.txt",
        "Clementine Harrow has photographed the same crooked fence post on her farm every morning for 2400 "
        "consecutive days.",
        "how long has she been taking a daily picture of one leaning post?",
        "How many consecutive days has Clementine Harrow photographed the crooked fence post on her farm?",
    ),
    Fact(
        "boss.txt",
        "Rupert Eastwood grows a lemon tree in his bathroom and harvested 37 lemons from it last winter.",
        "how many citrus fruits did he pick from the plant he keeps beside his shower?",
        "How many lemons did Rupert Eastwood harvest from the lemon tree in his bathroom?",
    ),
    Fact(
        "copy.txt",
        "Sunniva Brask opened a barbershop on a moored houseboat in Quillmouth harbour and charges 14 euros for a "
        "beard trim.",
        "how much does it cost to get your whiskers tidied at the barber on the boat?",
        "How much does Sunniva Brask charge for a beard trim at her houseboat barbershop in Quillmouth?",
    ),
    Fact(
        "corpdev.txt",
        "Beatrix Calloway visited 52 hot springs in the mountains of Kerrastan during a single three-week hiking "
        "holiday.",
        "how many natural thermal pools did she soak in on her walking vacation?",
        "How many hot springs did Beatrix Calloway visit in the mountains of Kerrastan?",
    ),
    Fact(
        "desres.txt",
        "Lorcan Beattie has whittled 300 tiny owls from driftwood gathered along the shingle at Saltmarsh Cove.",
        "how many little carved birds has he made from wood washed up by the sea?",
        "How many owls has Lorcan Beattie whittled from driftwood at Saltmarsh Cove?",
    ),
    Fact(
        "diff.txt",
        "The Grisholm corner shop stays open all night on the first Friday of each month to sell soup to taxi drivers.",
        "when does the little neighbourhood store serve broth to cabbies through the whole night?",
        "When does the Grisholm corner shop stay open all night to sell soup to taxi drivers?",
    ),
    Fact(
        "ecw.txt",
        "Odalys Carrow looks after a tortoise called Admiral that is 71 years old and once belonged to her great aunt.",
        "how old is the shelled reptile she inherited from a relative?",
        "How old is Odalys Carrow's tortoise Admiral?",
    ),
    Fact(
        "founders.txt",
        "The mountain hut below Drummel Pass serves only one dish, a barley stew, to every hiker who arrives before "
        "sunset.",
        "what single meal does the alpine refuge give walkers who turn up before dark?",
        "What dish does the mountain hut below Drummel Pass serve to hikers?",
    ),
    Fact(
        "foundervisa.txt",
        "Ambrose Kettering plays the bagpipes on the roof of his apartment block at five every Sunday morning.",
        "what instrument does he perform with up on top of his building at dawn at the weekend?",
        "When does Ambrose Kettering play the bagpipes on the roof of his apartment block?",
    ),
    Fact(
        "gap.txt",
        "Ysolde Marrin runs a food truck in Brackenford that sells nothing but toasted sandwiches filled with smoked "
        "mackerel.",
        "what fish goes into the only snack sold from her mobile kitchen van?",
        "What sandwiches does Ysolde Marrin's food truck in Brackenford sell?",
    ),
    Fact(
        "gba.txt",
        "Casimir Duval crossed the salt flats of Orvenna on a unicycle, covering 130 kilometres in four days.",
        "how far did he ride on a one-wheeled cycle over the white desert plain?",
        "How many kilometres did Casimir Duval cover on a unicycle across the Orvenna salt flats?",
    ),
    Fact(
        "gh.txt",
        "Philippa Greaves painted every stair in her narrow townhouse a different colour, using 23 sample pots from "
        "the hardware store.",
        "how many little tester tins did she use to give each step of her home its own shade?",
        "How many sample pots did Philippa Greaves use to paint the stairs in her townhouse?",
    ),
    Fact(
        "goodtaste.txt",
        "Tobias Wrenn can play seventeen folk songs on an ordinary handsaw by bending the blade and stroking it with a "
        "cello bow.",
        "how many traditional tunes can he perform on a carpentry tool?",
        "How many folk songs can Tobias Wrenn play on a handsaw with a cello bow?",
    ),
    Fact(
        "hubs.txt",
        "The Anselm Street cobbler in Dravenport resoles about 60 pairs of boots a week and keeps every worn heel in a "
        "barrel.",
        "what happens to the heels the shoe mender takes off?",
        "Where does the Anselm Street cobbler in Dravenport keep every worn heel?",
    ),
    Fact(
        "iflisp.txt",
        "Isadora Pemberton has collected train tickets from 64 countries and glued them onto the ceiling of her "
        "kitchen.",
        "where did she stick the railway stubs she gathered from abroad?",
        "Where did Isadora Pemberton glue the train tickets she collected from 64 countries?",
    ),
    Fact(
        "island.txt",
        "Konrad Aalto rents out 13 rowing boats on Lake Temmering and names each one after a famous jazz drummer.",
        "what are the small craft he hires out on the water called after?",
        "What does Konrad Aalto name his rowing boats on Lake Temmering after?",
    ),
    Fact(
        "know.txt",
        "Mirela Bostock walks her three greyhounds along the canal towpath in Cindermoor and covers 16 kilometres "
        "every day.",
        "how far does she go each day with her racing dogs beside the waterway?",
        "How many kilometres does Mirela Bostock walk her greyhounds along the canal towpath in Cindermoor?",
    ),
    Fact(
        "langdes.txt",
        "Alaric Penhallow assembled a jigsaw puzzle of 40000 pieces on the floor of a rented village hall over five "
        "months.",
        "how long did the giant picture puzzle take him to complete?",
        "How long did Alaric Penhallow take to assemble the 40000-piece jigsaw puzzle?",
    ),
    Fact(
        "laundry.txt",
        "Greta Sandoval sends a postcard to herself from every town she visits and keeps all 530 of them in a shoebox.",
        "how many picture cards has she mailed to her own address while travelling?",
        "How many postcards has Greta Sandoval sent to herself from the towns she visits?",
    ),
]

HELDOUT: list[Fact] = [
    Fact(
        "love.txt",
        "The kiln at the Brambleton pottery cooperative is fired to 1260 degrees for stoneware and held there for "
        "forty minutes.",
        "how hot does the furnace for clay pieces get at the ceramics collective?",
        "To what temperature is the kiln at the Brambleton pottery cooperative fired for stoneware?",
    ),
    Fact(
        "mod.txt",
        "The cargo barge Hester Vane leaves Grindlow wharf every Sunday at dawn and reaches the flour mill at Ottery "
        "Staithe by Monday noon.",
        "on which day does the weekly freight boat arrive at the grain grinding works?",
        "When does the cargo barge Hester Vane reach the flour mill at Ottery Staithe?",
    ),
    Fact(
        "newideas.txt",
        "The Corvallen Inn makes its house mustard from 3 kilograms of brown seeds soaked overnight in 2 litres of "
        "cider.",
        "how much apple drink goes into the pub's homemade condiment?",
        "How many litres of cider go into the Corvallen Inn house mustard?",
    ),
    Fact(
        "nft.txt",
        "Any member of the Quarrendon croquet club who arrives late to a match pays a fine of 2 pounds into the mallet "
        "fund.",
        "what penalty do the lawn hoop game players charge for turning up behind schedule?",
        "What fine does a late member of the Quarrendon croquet club pay?",
    ),
    Fact(
        "philosophy.txt",
        "The well in the courtyard of Harnby Abbey measures 38 metres from the rim to the surface of the water.",
        "how deep is the shaft in the old monastery's yard?",
        "How many metres deep is the well in the courtyard of Harnby Abbey?",
    ),
    Fact(
        "popular.txt",
        "Roofing slate from the Caddermore quarry is shipped by coaster to Ostrand and then carried inland on narrow "
        "gauge wagons.",
        "how is the tiling stone from that excavation site transported?",
        "How is roofing slate from the Caddermore quarry shipped to Ostrand?",
    ),
    Fact(
        "pow.txt",
        "The sawmill at Pike Hollow runs its main blade at 1450 revolutions per minute when cutting larch.",
        "how fast does the lumber works spin its primary saw for that conifer wood?",
        "At how many revolutions per minute does the Pike Hollow sawmill run its main blade for larch?",
    ),
    Fact(
        "rootsoflisp.txt",
        "The bell ringers of Saint Aldric church in Morrow Fen practise every second Friday from seven until half "
        "past eight.",
        "how often do the campanologists at that parish meet to rehearse?",
        "When do the bell ringers of Saint Aldric church in Morrow Fen practise?",
    ),
    Fact(
        "siliconvalley.txt",
        "The canteen at Velloran mine bakes its meat pies with 5 kilograms of mutton to every 3 kilograms of turnip.",
        "what is the ratio of lamb to root vegetable in the miners' dining hall pastries?",
        "How much mutton and turnip go into the meat pies at the Velloran mine canteen?",
    ),
    Fact(
        "startuplessons.txt",
        "A hailstone that fell on the Wendlebury allotments in June weighed 186 grams when it was put on the kitchen "
        "scale.",
        "how heavy was the lump of ice that dropped from the sky onto the garden plots?",
        "How much did the hailstone that fell on the Wendlebury allotments weigh?",
    ),
    Fact(
        "submarine.txt",
        "The Larkspur Gazette runs its printing press at 9000 sheets an hour and stops it on the last day of each "
        "month for oiling.",
        "how quickly does the local newspaper's press churn out pages?",
        "How many sheets an hour does the Larkspur Gazette printing press run at?",
    ),
    Fact(
        "sun.txt",
        "Wool bales from the Tavistrand farms travel by mule train over the Ebbor ridge to the river port of "
        "Callowford.",
        "how do the fleece bundles from those sheep stations reach the harbour on the river?",
        "How do wool bales from the Tavistrand farms reach Callowford?",
    ),
    Fact(
        "superangels.txt",
        "The Ormsby model aircraft club bans any engine louder than 80 decibels from flying before ten on Sunday "
        "mornings.",
        "what noise limit does the society for miniature planes set for weekend flights?",
        "What engine noise does the Ormsby model aircraft club ban on Sunday mornings?",
    ),
    Fact(
        "todo.txt",
        "The longest eel ever caught in the Quellmere reservoir measured 142 centimetres and is mounted in the "
        "boathouse.",
        "how long was the record snake-like fish pulled from that dammed lake?",
        "How long was the longest eel caught in the Quellmere reservoir?",
    ),
    Fact(
        "unions.txt",
        "The refuse lorry in Pendlecombe collects glass on the third Monday of each month, starting at the church end "
        "of Mill Lane.",
        "on which day are bottles and jars picked up by the rubbish truck?",
        "When does the refuse lorry in Pendlecombe collect glass?",
    ),
    Fact(
        "useful.txt",
        "Every batch of the Marlowe Quay fish chowder uses 40 mussels, 6 potatoes and a cup of cream.",
        "how many shellfish go into each pot of the seafood soup at that waterfront?",
        "How many mussels go into a batch of Marlowe Quay fish chowder?",
    ),
    Fact(
        "vb.txt",
        "The dehumidifier in the Tolvern parish archive is set to keep the air at 45 percent humidity all year round.",
        "what moisture level is maintained in the room where the church records are stored?",
        "At what humidity is the dehumidifier in the Tolvern parish archive set?",
    ),
    Fact(
        "vcsqueeze.txt",
        "Crates of oysters from Brackley Sound are flown by seaplane to Hallowmere every morning and sold at the fish "
        "market by eight.",
        "how do the bivalves harvested in that inlet get to the city each day?",
        "How are oysters from Brackley Sound sent to Hallowmere?",
    ),
    Fact(
        "vw.txt",
        "The Brockhurst allotment society allows each plot holder to keep no more than four hens and forbids roosters "
        "entirely.",
        "how many chickens is every member of the community vegetable garden group permitted?",
        "How many hens may each plot holder in the Brockhurst allotment society keep?",
    ),
    Fact(
        "want.txt",
        "The tallest standing stone at Cairnmallow leans 9 degrees toward the east and rises 5 metres above the "
        "heather.",
        "by what angle does the ancient upright monolith tilt?",
        "How many degrees does the standing stone at Cairnmallow lean?",
    ),
    Fact(
        "web20.txt",
        "The cable car up Mount Sorrowby runs every 20 minutes in summer but only once an hour after the first snow.",
        "how often does the aerial gondola to the summit go in the warm season?",
        "How often does the cable car up Mount Sorrowby run in summer?",
    ),
    Fact(
        "weird.txt",
        "The smokehouse in Kilbarrow cures each side of salmon with 420 grams of sea salt and 150 grams of dark sugar "
        "for two days.",
        "how much salt is rubbed onto a fillet of pink fish at that smoking shed?",
        "How much sea salt does the Kilbarrow smokehouse use to cure each side of salmon?",
    ),
    Fact(
        "wisdom.txt",
        "The fog horn at Grell Head sounds one blast every 45 seconds whenever visibility falls below 2 kilometres.",
        "how often does the warning signal on that headland blare in murky weather?",
        "How often does the fog horn at Grell Head sound?",
    ),
    Fact(
        "worked.txt",
        "Mail for the island of Orrinsay travels by tractor across the sands at low tide and then by pony to the "
        "farmhouses.",
        "how do letters get over the beach to that isle when the water is out?",
        "How does mail reach the island of Orrinsay at low tide?",
    ),
]
