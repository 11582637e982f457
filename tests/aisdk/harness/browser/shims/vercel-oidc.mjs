// ESM stand-in for @vercel/oidc, which ships CommonJS only (dist/index-browser.js uses
// require/module.exports), so a browser cannot import it without a bundler. `ai` imports it
// only through @ai-sdk/gateway (server-side model calls, never used by the chat UI).
// Mirrors @vercel/oidc's own browser build (dist/index-browser.js + dist/get-context.js).
export const SYMBOL_FOR_REQ_CONTEXT = Symbol.for('@vercel/request-context');
export function getContext() { return globalThis[SYMBOL_FOR_REQ_CONTEXT]?.get?.() ?? {}; }
export async function getVercelOidcToken() { return ''; }
export function getVercelOidcTokenSync() { return ''; }
export async function getVercelToken() { throw new Error('getVercelToken is not supported in browser environments'); }
export class AccessTokenMissingError extends Error { constructor(m = 'access token missing') { super(m); this.name = 'AccessTokenMissingError'; } }
export class RefreshAccessTokenFailedError extends Error { constructor(m = 'refresh failed') { super(m); this.name = 'RefreshAccessTokenFailedError'; } }
