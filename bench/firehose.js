// Firehose: publisher connections and one consumer connection, 100-byte messages.
// usage: node bench/firehose.js URL transient|persistent|quorum COUNT [PUBLISHERS]
// quorum: persistent messages with confirms on a durable queue declared x-queue-type=quorum
// (a replicated queue on RabbitMQ; on Tandem every queue is replicated by default).
// Prints one JSON line: {mode, count, publishers, seconds, rate, received}. Exits non-zero if
// any message is missing, duplicated or out of order (per publisher).
'use strict';
const amqp = require('amqplib');

async function main() {
  const [url, mode, countArg] = process.argv.slice(2);
  const count = Number(countArg);
  const publishers = Number(process.argv[5] || 1);
  const persistent = mode === 'persistent' || mode === 'quorum';
  const queue = `firehose-${mode}-${process.pid}-${Date.now()}`;
  const pubConns = [];
  for (let p = 0; p < publishers; p++) pubConns.push(await amqp.connect(url));
  const subConn = await amqp.connect(url);
  // A connection or channel the broker closes mid-run fails the run loudly: otherwise the
  // pending promises would never settle and node would exit 0 with nothing printed.
  let finishing = false;
  const watch = (what, emitter) => {
    emitter.on('error', (err) => { console.error(`${what} error: ${err.message}`); process.exit(3); });
    emitter.on('close', () => { if (!finishing) { console.error(`${what} closed mid-run`); process.exit(3); } });
  };
  pubConns.forEach((c, i) => watch(`publisher connection ${i}`, c));
  watch('consumer connection', subConn);
  const sub = await subConn.createChannel();
  const options = mode === 'quorum'
    ? { durable: true, arguments: { 'x-queue-type': 'quorum' } }
    : persistent ? { durable: true } : { durable: false, autoDelete: true };
  await sub.assertQueue(queue, options);
  await sub.prefetch(1000);
  const pubs = [];
  for (const c of pubConns) pubs.push(persistent ? await c.createConfirmChannel() : await c.createChannel());
  pubs.forEach((ch, i) => watch(`publisher channel ${i}`, ch));
  watch('consumer channel', sub);
  const body = Buffer.alloc(100, 'x');

  let received = 0;
  const expected = new Array(publishers).fill(0);
  let bad = 0;
  let resolveDone;
  const done = new Promise((r) => { resolveDone = r; });
  await sub.consume(queue, (msg) => {
    if (msg === null) return; // cancelled by the broker when the queue is deleted
    const n = msg.content.readUInt32BE(0);
    const p = msg.content.readUInt16BE(4);
    if (n !== expected[p]) bad++;
    expected[p] = n + 1;
    received++;
    sub.ack(msg);
    if (received === count) resolveDone();
  });

  const start = process.hrtime.bigint();
  let confirmed = 0;
  let confirmsDone = persistent ? null : Promise.resolve();
  let resolveConfirms;
  if (persistent) confirmsDone = new Promise((r) => { resolveConfirms = r; });
  const onConfirm = (err) => {
    if (err) bad++;
    confirmed++;
    if (confirmed === count) resolveConfirms();
  };
  const publish = async (p) => {
    const pub = pubs[p];
    const share = Math.floor(count / publishers) + (p < count % publishers ? 1 : 0);
    for (let i = 0; i < share; i++) {
      const b = Buffer.from(body);
      b.writeUInt32BE(i, 0);
      b.writeUInt16BE(p, 4);
      const ok = persistent
        ? pub.sendToQueue(queue, b, { persistent: true }, onConfirm)
        : pub.sendToQueue(queue, b);
      if (!ok) await new Promise((r) => pub.once('drain', r));
    }
  };
  await Promise.all(pubs.map((_, p) => publish(p)));
  await Promise.all([done, confirmsDone]);
  const seconds = Number(process.hrtime.bigint() - start) / 1e9;
  finishing = true;
  await sub.deleteQueue(queue);
  for (const c of pubConns) await c.close();
  await subConn.close();
  console.log(JSON.stringify({ mode, count, publishers, seconds, rate: count / seconds, received, bad }));
  if (bad || received !== count) process.exit(1);
}

// Nothing left to wait for, yet no result: a promise that can no longer settle (a frame the
// broker never sent). Said, not hidden behind exit code 0.
let settled = false;
process.on('beforeExit', () => {
  if (!settled) { console.error('the run stalled: nothing left to wait for, no result'); process.exit(4); }
});
main().then(() => { settled = true; }).catch((err) => { console.error(err); process.exit(2); });
