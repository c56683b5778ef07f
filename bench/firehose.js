// Firehose: publisher connections and consumer connections, one workload, one JSON line.
// usage: node bench/firehose.js URL transient|persistent|quorum COUNT [PUBLISHERS] [OPTION=VALUE...]
//   size=BYTES      message body size (default 100)
//   ack=1|N         the consumer acks each message (1), or with `multiple` every N (default 1)
//   window=N        a publisher waits while N of its publishes are unconfirmed (default: none,
//                   only the socket's backpressure); persistent and quorum modes only
//   fanout=Q        publish to a fanout exchange bound to Q queues, each consumed (COUNT x Q
//                   deliveries)
//   pairs=P         P publisher and consumer connections, each pair on its own queue (the
//                   publishers argument is then P)
//   topic=B         publish to a topic exchange with B pattern bindings (`k.<i>.#`), each to its
//                   own queue, routing keys taking turns so that each message lands in one queue
// quorum: persistent messages with confirms on durable queues declared x-queue-type=quorum
// (replicated on RabbitMQ; on Tandem every queue is replicated by default).
// Prints {mode, count, publishers, seconds, rate, received, bad, ...options}; rate counts
// published messages per second, end to end (the last one consumed). Exits non-zero if any
// delivery is missing, duplicated or out of order (per publisher and queue).
'use strict';
const amqp = require('amqplib');

function options(args) {
  const out = { size: 100, ack: 1, window: 0, fanout: 0, pairs: 0, topic: 0 };
  for (const arg of args) {
    const [key, value] = arg.split('=');
    if (!(key in out) || value === undefined || Number.isNaN(Number(value))) {
      console.error(`unknown option ${arg}`);
      process.exit(2);
    }
    out[key] = Number(value);
  }
  return out;
}

async function main() {
  const [url, mode, countArg, publishersArg, ...rest] = process.argv.slice(2);
  const count = Number(countArg);
  const opt = options(rest);
  const publishers = opt.pairs || Number(publishersArg || 1);
  const persistent = mode === 'persistent' || mode === 'quorum';
  const tag = `firehose-${mode}-${process.pid}-${Date.now()}`;
  const queueCount = opt.fanout || opt.topic || opt.pairs || 1;
  const queues = Array.from({ length: queueCount }, (_, i) => `${tag}-${i}`);
  const pubConns = [];
  for (let p = 0; p < publishers; p++) pubConns.push(await amqp.connect(url));
  const subConns = [];
  for (let c = 0; c < (opt.pairs || 1); c++) subConns.push(await amqp.connect(url));
  // A connection or channel the broker closes mid-run fails the run loudly: otherwise the
  // pending promises would never settle and node would exit 0 with nothing printed.
  let finishing = false;
  const watch = (what, emitter) => {
    emitter.on('error', (err) => { console.error(`${what} error: ${err.message}`); process.exit(3); });
    emitter.on('close', () => { if (!finishing) { console.error(`${what} closed mid-run`); process.exit(3); } });
  };
  pubConns.forEach((c, i) => watch(`publisher connection ${i}`, c));
  subConns.forEach((c, i) => watch(`consumer connection ${i}`, c));
  const subs = [];
  for (const c of subConns) {
    const ch = await c.createChannel();
    watch('consumer channel', ch);
    await ch.prefetch(Math.max(1000, opt.ack * 2));
    subs.push(ch);
  }
  const declare = mode === 'quorum'
    ? { durable: true, arguments: { 'x-queue-type': 'quorum' } }
    : persistent ? { durable: true } : { durable: false, autoDelete: true };
  for (const q of queues) await subs[0].assertQueue(q, declare);
  let exchange = '';
  if (opt.fanout || opt.topic) {
    exchange = tag;
    await subs[0].assertExchange(exchange, opt.fanout ? 'fanout' : 'topic', { durable: persistent, autoDelete: !persistent });
    for (let i = 0; i < queues.length; i++) {
      await subs[0].bindQueue(queues[i], exchange, opt.fanout ? '' : `k.${i}.#`);
    }
  }
  const pubs = [];
  for (const c of pubConns) pubs.push(persistent ? await c.createConfirmChannel() : await c.createChannel());
  pubs.forEach((ch, i) => watch(`publisher channel ${i}`, ch));
  const body = Buffer.alloc(Math.max(opt.size, 8), 'x');

  const total = opt.fanout ? count * queues.length : count;
  let received = 0;
  let bad = 0;
  const expected = new Map(); // `${queue}/${publisher}` -> next number
  let resolveDone;
  const done = new Promise((r) => { resolveDone = r; });
  const unacked = subs.map(() => 0); // per channel: `multiple` acks all of a channel's
  for (let i = 0; i < queues.length; i++) {
    const c = opt.pairs ? i : 0;
    const ch = subs[c];
    await ch.consume(queues[i], (msg) => {
      if (msg === null) return; // cancelled by the broker when the queue is deleted
      const n = msg.content.readUInt32BE(0);
      const key = `${i}/${msg.content.readUInt16BE(4)}`;
      // Per publisher, a queue's messages come in order; with topic routing, a publisher's
      // messages are spread over the queues, so only an increase is required there.
      const want = expected.get(key) || 0;
      if (opt.topic ? n < want : n !== want) bad++;
      expected.set(key, n + 1);
      received++;
      if (opt.ack <= 1) ch.ack(msg);
      else if (++unacked[c] === opt.ack || received === total) { ch.ack(msg, true); unacked[c] = 0; }
      if (received === total) resolveDone();
    });
  }

  const start = process.hrtime.bigint();
  const cpuStart = process.cpuUsage();
  let confirmed = 0;
  let resolveConfirms;
  const confirmsDone = persistent ? new Promise((r) => { resolveConfirms = r; }) : Promise.resolve();
  const publish = async (p) => {
    const pub = pubs[p];
    const share = Math.floor(count / publishers) + (p < count % publishers ? 1 : 0);
    let outstanding = 0;
    let wake = null;
    const onConfirm = (err) => {
      if (err) bad++;
      confirmed++;
      outstanding--;
      if (wake) { const w = wake; wake = null; w(); }
      if (confirmed === count) resolveConfirms();
    };
    for (let i = 0; i < share; i++) {
      const b = Buffer.from(body);
      b.writeUInt32BE(i, 0);
      b.writeUInt16BE(p, 4);
      const target = opt.pairs ? queues[p] : queues[0];
      const key = opt.topic ? `k.${i % queues.length}.x` : target;
      let ok;
      if (persistent) {
        if (opt.window) {
          while (outstanding >= opt.window) await new Promise((r) => { wake = r; });
        }
        outstanding++;
        ok = pub.publish(exchange, exchange ? key : target, b, { persistent: true }, onConfirm);
      } else {
        ok = pub.publish(exchange, exchange ? key : target, b);
      }
      if (!ok) await new Promise((r) => pub.once('drain', r));
    }
  };
  await Promise.all(pubs.map((_, p) => publish(p)));
  await Promise.all([done, confirmsDone]);
  const seconds = Number(process.hrtime.bigint() - start) / 1e9;
  const cpu = process.cpuUsage(cpuStart);
  // The client's own CPU (one thread runs its JavaScript): near `seconds`, the client is the limit.
  const clientCpu = (cpu.user + cpu.system) / 1e6;
  finishing = true;
  for (const q of queues) await subs[0].deleteQueue(q);
  if (exchange) await subs[0].deleteExchange(exchange);
  for (const c of pubConns) await c.close();
  for (const c of subConns) await c.close();
  console.log(JSON.stringify({ mode, count, publishers, seconds, rate: count / seconds, clientCpu, received, bad, ...opt }));
  if (bad || received !== total) process.exit(1);
}

// Nothing left to wait for, yet no result: a promise that can no longer settle (a frame the
// broker never sent). Said, not hidden behind exit code 0.
let settled = false;
process.on('beforeExit', () => {
  if (!settled) { console.error('the run stalled: nothing left to wait for, no result'); process.exit(4); }
});
main().then(() => { settled = true; }).catch((err) => { console.error(err); process.exit(2); });
