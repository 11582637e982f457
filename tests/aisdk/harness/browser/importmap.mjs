// Builds a browser import map for the `ai` package straight out of node_modules (no bundler):
// walks the static ESM import graph from the package entry, resolving bare specifiers with
// the conditions a browser would want (browser > import > module > default) and checking
// that every relative specifier exists exactly as written (browsers do no extension or
// index resolution). Prints / returns { imports, files, dynamic, problems }.
//
//   node browser/importmap.mjs ai6        # v6 page
//   node browser/importmap.mjs ai5        # v5 page
import fs from 'node:fs';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

const ROOT = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..'); // harness/
const CONDITIONS = ['browser', 'import', 'module', 'default'];

function pickExport(target) {
  if (typeof target === 'string') return target;
  if (Array.isArray(target)) { for (const t of target) { const r = pickExport(t); if (r) return r; } return null; }
  if (target && typeof target === 'object') {
    for (const c of CONDITIONS) if (c in target) { const r = pickExport(target[c]); if (r) return r; }
  }
  return null;
}

// node-style lookup of the package dir from an importing file
function findPkgDir(name, fromFile) {
  let dir = path.dirname(fromFile);
  for (;;) {
    const cand = path.join(dir, 'node_modules', name);
    if (fs.existsSync(path.join(cand, 'package.json'))) return cand;
    const up = path.dirname(dir);
    if (up === dir) return null;
    dir = up;
  }
}

function resolveBare(spec, fromFile) {
  const parts = spec.split('/');
  const name = spec.startsWith('@') ? parts.slice(0, 2).join('/') : parts[0];
  const sub = '.' + spec.slice(name.length); // '.' or './v4'
  const dir = findPkgDir(name, fromFile);
  if (!dir) return { error: `package not found: ${name}` };
  const pkg = JSON.parse(fs.readFileSync(path.join(dir, 'package.json'), 'utf8'));
  let rel = null;
  if (pkg.exports) {
    const ex = typeof pkg.exports === 'string' || Array.isArray(pkg.exports) || !Object.keys(pkg.exports).some((k) => k.startsWith('.'))
      ? { '.': pkg.exports } : pkg.exports;
    if (ex[sub] !== undefined) rel = pickExport(ex[sub]);
    else {
      for (const [k, v] of Object.entries(ex)) { // "./*" patterns
        if (k.includes('*')) {
          const [pre, post] = k.split('*');
          if (sub.startsWith(pre) && sub.endsWith(post)) {
            const star = sub.slice(pre.length, sub.length - post.length);
            rel = pickExport(v)?.replace('*', star);
          }
        }
      }
    }
  } else if (sub === '.') rel = pkg.module ?? pkg.main ?? 'index.js';
  if (!rel) return { error: `no export ${sub} in ${name}` };
  const file = path.join(dir, rel);
  return fs.existsSync(file) ? { file, pkg: `${pkg.name}@${pkg.version}` } : { error: `missing file ${file}` };
}

const RE_STATIC = /(?:^|[;\s}])(?:import|export)\s*(?:[\w$*{}\s,]*?\s*from\s*)?["']([^"'\n]+)["']/g;
const RE_DYNAMIC = /\bimport\(\s*["']([^"'\n]+)["']\s*\)/g;

export function buildImportMap(entrySpec, { urlPrefix = '/' } = {}) {
  const imports = {}, urlFixes = {}, shims = {}, files = new Set(), dynamic = [], problems = [], pkgs = new Set();
  const entry = resolveBare(entrySpec, path.join(ROOT, 'x.mjs'));
  if (entry.error) throw new Error(entry.error);
  const toUrl = (f) => urlPrefix + path.relative(ROOT, f).split(path.sep).join('/');
  const queue = [entry.file];
  pkgs.add(entry.pkg);
  while (queue.length) {
    const f = queue.shift();
    if (files.has(f)) continue;
    files.add(f);
    const src = fs.readFileSync(f, 'utf8');
    for (const m of src.matchAll(RE_DYNAMIC)) dynamic.push({ from: path.relative(ROOT, f), spec: m[1] });
    for (const m of src.matchAll(RE_STATIC)) {
      const spec = m[1];
      if (spec.startsWith('node:')) { problems.push(`${path.relative(ROOT, f)} statically imports ${spec}`); continue; }
      if (spec.startsWith('.') || spec.startsWith('/')) {
        const target = path.resolve(path.dirname(f), spec);
        if (fs.existsSync(target) && !fs.statSync(target).isDirectory()) { queue.push(target); continue; }
        // extensionless TypeScript output (@opentelemetry/api/build/esm): browsers do no
        // extension resolution, but an import map can remap the *resolved URL* itself.
        const fixed = [target + '.js', path.join(target, 'index.js')].find((c) => fs.existsSync(c));
        if (!fixed) { problems.push(`${path.relative(ROOT, f)}: relative import ${spec} not found`); continue; }
        urlFixes[toUrl(target)] = toUrl(fixed);
        queue.push(fixed);
        continue;
      }
      const r = resolveBare(spec, f);
      if (r.error) { problems.push(`${path.relative(ROOT, f)}: ${spec}: ${r.error}`); continue; }
      pkgs.add(r.pkg);
      let url = toUrl(r.file);
      const body = fs.readFileSync(r.file, 'utf8');
      if (!/^\s*export\b/m.test(body) && /\bmodule\.exports\b|\brequire\(/.test(body)) {
        // CommonJS: not importable by a browser. Use a hand-written ESM shim if there is one.
        const shim = path.join(ROOT, 'browser/shims', spec.replace(/^@/, '').replace(/\//g, '-') + '.mjs');
        if (!fs.existsSync(shim)) { problems.push(`${spec} (${path.relative(ROOT, r.file)}) is CommonJS; no shim`); continue; }
        shims[spec] = `${path.relative(ROOT, r.file)} is CommonJS -> ${path.relative(ROOT, shim)}`;
        imports[spec] = toUrl(shim);
        continue;
      }
      if (imports[spec] && imports[spec] !== url) problems.push(`specifier ${spec} maps to two files (${imports[spec]} / ${url}); needs import-map scopes`);
      imports[spec] ??= url;
      queue.push(r.file);
    }
  }
  imports[entrySpec === 'ai5' || entrySpec === 'ai6' ? 'ai' : entrySpec] = toUrl(entry.file);
  Object.assign(imports, urlFixes);
  return { shims, urlFixes: Object.keys(urlFixes).length, imports, files: [...files].map((f) => path.relative(ROOT, f)).sort(), dynamic, problems, packages: [...pkgs].sort() };
}

if (import.meta.url === `file://${process.argv[1]}`) {
  const r = buildImportMap(process.argv[2] ?? 'ai6');
  console.log(JSON.stringify(r, null, 1));
}
