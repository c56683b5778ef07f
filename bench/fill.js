// Fill a queue with COUNT transient 100-byte messages through a confirm channel and wait for
// every confirm; the queue is left full for the caller to measure the broker's memory.
// usage: node bench/fill.js URL QUEUE COUNT
'use strict';
const amqp = require('amqplib');

async function main() {
  const [url, queue, countArg] = process.argv.slice(2);
  const count = Number(countArg);
  const conn = await amqp.connect(url);
  const ch = await conn.createConfirmChannel();
  await ch.assertQueue(queue, { durable: false });
  const body = Buffer.alloc(100, 'y');
  let confirmed = 0;
  let nacked = 0;
  const all = new Promise((resolve) => {
    const cb = (err) => { if (err) nacked++; if (++confirmed === count) resolve(); };
    (async () => {
      for (let i = 0; i < count; i++) {
        if (!ch.sendToQueue(queue, body, {}, cb)) await new Promise((r) => ch.once('drain', r));
      }
    })();
  });
  await all;
  const { messageCount } = await ch.checkQueue(queue);
  console.log(JSON.stringify({ queue, confirmed, nacked, messageCount }));
  await conn.close();
  if (nacked || messageCount !== count) process.exit(1);
}

main().catch((err) => { console.error(err); process.exit(2); });
