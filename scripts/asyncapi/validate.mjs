// Validates an AsyncAPI document with the official parser (@asyncapi/parser, pinned in
// package.json): references resolved relative to the document's own file, the AsyncAPI schema
// and the parser's rules applied. Then each message example is checked against its message's
// headers and payload schemas with Ajv, which the parser's AsyncAPI 3 rules do not do.
// Prints every diagnostic; exits 1 on any error or warning (or an example its schema refuses),
// 2 when it cannot run. Usage: node scripts/asyncapi/validate.mjs docs/asyncapi.yaml
import { Parser, fromFile } from '@asyncapi/parser';
import Ajv from 'ajv';
import Ajv2020 from 'ajv/dist/2020.js';
import addFormats from 'ajv-formats';
import path from 'node:path';

const SEVERITY = ['error', 'warning', 'information', 'hint'];

/** Prints the parser's diagnostics; returns how many are errors or warnings. */
function report(file, source, diagnostics) {
  for (const d of diagnostics) {
    const at = d.path.length ? d.path.join('.') : '(document)';
    const line = d.range ? `:${d.range.start.line + 1}` : '';
    const where = d.source && d.source !== source ? path.relative(process.cwd(), d.source) : file;
    console.log(`${SEVERITY[d.severity] ?? d.severity}: ${where}${line} ${at}: ${d.message} [${d.code}]`);
  }
  return diagnostics.filter((d) => d.severity <= 1).length;
}

/**
 * A copy of a resolved schema with its cycles (a recursive schema, which the parser resolves
 * into objects that contain themselves) written back as `$ref`s to the enclosing schema, and
 * the parser's own `x-parser-` annotations left out, so Ajv can compile it.
 */
function acyclic(node, ancestors = new Map(), pointer = '#') {
  if (node === null || typeof node !== 'object') return node;
  if (ancestors.has(node)) return { $ref: ancestors.get(node) };
  ancestors.set(node, pointer);
  const copy = Array.isArray(node) ? [] : {};
  for (const [k, v] of Object.entries(node)) {
    if (k.startsWith('x-parser-')) continue;
    copy[k] = acyclic(v, ancestors, `${pointer}/${String(k).replaceAll('~', '~0').replaceAll('/', '~1')}`);
  }
  ancestors.delete(node);
  return copy;
}

/** Checks every message example against its headers and payload schemas; returns the failures. */
function checkExamples(document) {
  const make = (Kind) => addFormats(new Kind({ strict: false, allErrors: true, validateSchema: false }));
  const draft07 = make(Ajv);
  const draft2020 = make(Ajv2020);
  let failures = 0;
  for (const message of document.messages().all()) {
    for (const [n, example] of message.examples().all().entries()) {
      for (const part of ['headers', 'payload']) {
        const schema = message[part]();
        const value = example[part]();
        if (!schema || value === undefined) continue;
        const json = acyclic(schema.json());
        const ajv = String(json.$schema ?? '').includes('2020-12') ? draft2020 : draft07;
        delete json.$id;
        const validate = ajv.compile(json);
        if (!validate(value)) {
          failures += 1;
          const name = example.name() ?? n;
          for (const e of validate.errors) {
            console.log(`error: example ${name} of message ${message.name()}: ${part}${e.instancePath} ${e.message}`);
          }
        }
      }
    }
  }
  return failures;
}

async function main() {
  const [file] = process.argv.slice(2);
  if (!file) {
    console.error('usage: node validate.mjs <asyncapi document>');
    return 2;
  }
  const source = path.resolve(file);
  const { document, diagnostics } = await fromFile(new Parser(), source).parse();
  const failing = report(file, source, diagnostics) + (document ? checkExamples(document) : 0);
  if (!document || failing > 0) {
    console.error(`${file}: ${failing} error(s) and warning(s)${document ? '' : '; not parsed'}`);
    return 1;
  }
  const list = (items, name) => items.all().map(name).join(', ');
  console.log(
    `${file}: AsyncAPI ${document.version()}, valid, its examples too: channels ` +
      `${list(document.channels(), (c) => c.address())}; operations ` +
      `${list(document.operations(), (o) => o.id())}; messages ${list(document.messages(), (m) => m.name())}`,
  );
  return 0;
}

main().then(
  (code) => process.exit(code),
  (error) => {
    console.error(error);
    process.exit(2);
  },
);
