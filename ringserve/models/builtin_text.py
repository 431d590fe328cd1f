"""A fixed English text the built-in model's tokenizer is trained on.

Changing one character changes the trained vocabulary, so any edit must come
with a new `BUILTIN_VERSION` in `builtin.py`.
"""

from __future__ import annotations

CORPUS = """\
The river starts as a thin stream high in the hills, where snow melts slowly in the spring.
By the time it reaches the town it is wide and brown, and children throw stones from the old stone bridge.
Farmers along the valley use its water for their fields of wheat, barley, beans and potatoes.
In the summer the water is low and warm, and in the autumn the leaves turn red and gold along the banks.
Every morning the baker opens her shop before the sun is up. She mixes flour, water, salt and yeast,
and the dough rests while she lights the oven. The first loaves are ready at six o'clock,
and by seven there is a line of people waiting at the door with baskets and bags.
A computer is a machine that follows instructions. A program is a list of those instructions,
written in a language that people can read and the machine can translate. Good programs are simple,
clear and tested. When a program fails, the engineer reads the error, forms a guess, and checks it.
Numbers can be added, subtracted, multiplied and divided. One plus one is two; two times three is six;
ten divided by five is two. The first prime numbers are two, three, five, seven, eleven and thirteen.
The library in the centre of the city has three floors. On the first floor there are newspapers and maps;
on the second there are books about history, science, music and art; on the third there is a quiet room
where students study until the building closes at nine in the evening.
Weather changes from day to day. Today it may be sunny and bright, tomorrow cloudy with light rain,
and the day after that cold and windy. People check the forecast, carry an umbrella, and hope for the best.
A good meal does not need to be complicated. Fresh bread, a bowl of soup, some cheese and an apple
can make a fine lunch. In the evening a family might share rice, vegetables, fish or chicken,
and talk about what happened during the day.
The train leaves the station at a quarter past eight. It stops at four small towns before it reaches
the coast, where the sea is grey in winter and blue in summer. Passengers read, sleep, look out of the window,
or talk quietly on the telephone. The journey takes about two hours.
Music is made of sound and silence. A melody is a line of notes, a rhythm is a pattern in time,
and harmony is what happens when several notes sound together. Some people play the piano or the guitar;
others sing in a choir, and many simply listen while they work, walk or cook.
Learning a new skill takes patience. At first everything feels slow and difficult, and mistakes are common.
With practice the hands and the mind learn together, and what once needed careful thought becomes easy.
Teachers, books and friends can help, but in the end each person must do the work themselves.
The garden behind the house is small but full of life. There are roses near the wall, tomatoes and herbs
in wooden boxes, and a tall tree that gives shade in the afternoon. Birds visit the feeder, bees move
from flower to flower, and at night a hedgehog sometimes crosses the grass looking for food.
Questions are the beginning of knowledge. Why is the sky blue? How do plants grow? What makes the tides
rise and fall? Scientists answer such questions by observing carefully, measuring, making models,
and testing their ideas against the world. When the evidence changes, good scientists change their minds.
The market on Saturday is the busiest place in town. Traders sell fruit, vegetables, flowers, clothes,
old records, tools and toys. People bargain, laugh, meet their neighbours, and carry home more than they planned.
Hello! How are you today? I am fine, thank you. What would you like to do this weekend?
Perhaps we could visit the museum, take a walk in the park, or go to the cinema in the evening.
Please send me a message when you are ready, and I will meet you at the corner by the post office.
A clock measures time in hours, minutes and seconds. There are sixty seconds in a minute, sixty minutes
in an hour, and twenty four hours in a day. A week has seven days: Monday, Tuesday, Wednesday, Thursday,
Friday, Saturday and Sunday. A year has twelve months, from January to December.
The ship sailed north for many days through calm water and heavy storms. The captain kept a careful log
of the wind, the stars and the depth of the sea. When at last the sailors saw land, they cheered,
and the cook made a special dinner to celebrate their safe arrival.
Writing clearly is a kindness to the reader. Use short sentences when you can, choose plain words,
and say one thing at a time. Read your work aloud, remove what is not needed, and ask a friend to check it.
Mountains are slow giants. They rise over millions of years as the plates of the earth push against each other,
and they wear down again under ice, wind and rain. Climbers prepare for weeks, studying routes, packing ropes,
boots, gloves, maps and food, because the weather near the summit can change without warning.
An orchestra tunes before the concert begins. The oboe plays a single note and the violins, cellos, flutes,
clarinets, trumpets and drums follow. Then the conductor raises a hand, the hall falls silent,
and the first movement of the symphony fills the room.
Doctors and nurses work long shifts in the hospital. They listen to patients, measure temperature and pressure,
explain treatments, and comfort families. Medicine has changed a great deal in a century: vaccines,
antibiotics and careful hygiene have saved countless lives.
The old lighthouse stands on a rock at the edge of the bay. For a hundred years its lamp turned every night,
warning ships away from the reef. Today the light is automatic, but visitors still climb the narrow stairs
to see the view of the harbour, the cliffs and the fishing boats returning with their catch.
Language lets us share ideas across distance and time. Letters, newspapers, radio, television and the internet
have each changed how quickly news travels. A story told by a grandmother, however, still carries something
that no machine can copy: the voice, the pause, the smile at the funny part.
Cats are curious, independent animals. They sleep for much of the day, hunt at dawn and dusk, and choose
carefully whom they trust. Dogs, by contrast, are eager companions who enjoy long walks, games of fetch,
and the simple pleasure of being near their people.
Building a house begins with a plan. Architects draw the rooms, engineers calculate the loads on beams
and foundations, and builders pour concrete, raise walls, fit windows and lay the roof. Electricians
and plumbers follow, and finally painters bring colour to every surface.
Money is a promise that others will accept in exchange for goods and services. Banks keep savings,
lend to businesses, and move payments between accounts. A sensible budget lists income and expenses,
sets aside something for emergencies, and avoids debts that cannot be repaid.
Football, tennis, swimming, cycling and running are popular sports. Athletes train their bodies with
exercise, rest and good food, and they train their minds with focus and discipline. Win or lose,
a fair game played with respect is worth watching.
Winter evenings are long and dark. Families gather near the fire, drink hot tea or chocolate, play cards,
knit scarves, read novels or tell stories. Outside, frost covers the windows and the streets are quiet,
except for the crunch of boots on fresh snow.
Electricity flows through wires like water through pipes. Voltage pushes the current, resistance slows it,
and power measures how much work it can do each second. Batteries store chemical energy, solar panels
capture sunlight, and turbines turn the motion of wind or water into electric current.
The festival lasts three days. There are parades with bright costumes, stalls selling sweets and spices,
dancers in the square, and fireworks over the river on the final night. Visitors come from far away,
and the hotels, cafes and restaurants are full from morning until midnight.
Good friends listen without judging, tell the truth kindly, and remember small details. They celebrate
your successes, help when things go wrong, and forgive mistakes. Friendship, like a garden, grows
when it is given attention and time.
Ancient cities were often built near rivers, where water, fertile soil and trade routes met. Their people
invented writing, calendars, laws, roads and aqueducts. Archaeologists study the ruins, pottery, coins
and tools they left behind to understand how they lived, worked, worshipped and governed themselves.
Coffee is grown on farms in warm, wet hills near the equator. The red cherries are picked, dried,
roasted and ground. Every culture has its own way to prepare it: strong and sweet, with milk and foam,
poured over ice, or brewed slowly in a glass pot on the stove.
"""
